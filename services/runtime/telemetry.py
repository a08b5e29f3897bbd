"""OpenTelemetry tracing for the services: one tracer provider per process, W3C trace context
carried in gRPC metadata (router -> decode -> prefill), spans exported over OTLP/gRPC to a
collector (Jaeger, Tempo, an OpenTelemetry Collector) and/or as JSON lines to a file, when
configured; nothing is exported otherwise.

Callers: each service's `main()` calls `setup_tracing` once; clients call `inject_metadata(ctx)`
to get the metadata of an outgoing call; servicers call `extract_context(context)` and start
their span under it. Code that yields (async generators: streaming servicers, the router's
dispatcher) must not use `start_as_current_span` across a yield (the generator may resume in
another task's context): start spans with an explicit parent (`child_context(span)`) and end them.
"""

from __future__ import annotations

import json
import threading

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult

_provider_lock = threading.Lock()
OTLP_EXPORT_DELAY_MS = 500


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line (trace/span/parent ids in hex)."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in shutdown()
        self._lock = threading.Lock()

    def export(self, spans) -> SpanExportResult:
        lines = [json.dumps(_span_record(s)) + "\n" for s in spans]
        with self._lock:
            self._file.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def _span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    assert ctx is not None, "a finished span has a context"
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {k: v for k, v in (span.attributes or {}).items() if isinstance(v, (str, int, float, bool))},
    }


def setup_tracing(service_name: str, trace_file: str | None, otlp_endpoint: str | None = None) -> TracerProvider:
    """Install the process's tracer provider (idempotent per process). OTLP spans go out in
    batches (every `OTLP_EXPORT_DELAY_MS`, and at exit)."""
    with _provider_lock:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if trace_file:
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https://"))
            provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=OTLP_EXPORT_DELAY_MS))
        trace.set_tracer_provider(provider)
        return provider


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def child_context(span: trace.Span) -> Context:
    """A context whose current span is `span` (the parent of spans started with it)."""
    return trace.set_span_in_context(span)


def inject_metadata(ctx: Context | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current (or given) trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items())


def extract_context(servicer_context) -> Context:
    """The caller's trace context from a gRPC servicer context's invocation metadata."""
    carrier = {key: value for key, value in (servicer_context.invocation_metadata() or ()) if isinstance(value, str)}
    return propagate.extract(carrier)
