"""Prometheus metrics of the services, with the names the Gateway API Inference Extension reads
from model servers by default (vLLM's): `vllm:num_requests_waiting` (queued),
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (also as the older
`vllm:gpu_cache_usage_perc`), plus TTFT / inter-token-latency histograms and prefix-cache
counters, and vLLM's request metrics with vLLM's semantics and buckets, so vLLM dashboards work
unchanged: per finished request on the decode worker (where it runs to the end),
`vllm:e2e_request_latency_seconds` (arrival at the worker -> last token),
`vllm:request_queue_time_seconds` (arrival -> first admitted), `vllm:request_prefill_time_seconds`
(admitted -> first token, a remote prefill included), `vllm:request_decode_time_seconds` (first ->
last token), `vllm:request_inference_time_seconds` (admitted -> last token), the prompt and
generation token counters and histograms, and `vllm:request_success_total{finished_reason}`.
A prefill worker counts only its own prefills (`moemesh:prefills_total`), so a request is counted
once in the mesh. moemesh-only metrics use the `moemesh:` prefix.

Each service owns one `CollectorRegistry` (no process-global default registry), created in its
`main()`. Gauges and counters of the engine are read from a stats callable at scrape time.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
# vLLM's buckets for the metrics that carry its names
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series


class LatencyWindow:
    """The last `size` samples of a latency, for the p90 a worker heartbeats into the registry."""

    def __init__(self, size: int = 256):
        self._samples: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def quantile(self, q: float) -> float:
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _EngineStatsCollector:
    """Exports an engine's `stats()` dict (read at scrape time) as gauges and counters."""

    def __init__(self, stats: Callable[[], dict], labels: dict[str, str]):
        self._stats = stats
        self._labels = labels

    def collect(self):
        stats = self._stats() or {}
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting for admission (queued).", stats.get("num_waiting", 0)
        )
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.get("num_running", 0))
        usage = stats.get("kv_usage", 0.0)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full); older name.", usage)
        yield gauge(
            "moemesh:num_requests_waiting_for_kv",
            "Admitted requests waiting for remote KV.",
            stats.get("num_waiting_for_kv", 0),
        )
        yield gauge("moemesh:kv_blocks_used", "KV blocks referenced by requests.", stats.get("num_blocks_used", 0))
        yield gauge("moemesh:kv_blocks_total", "KV blocks in the pool.", stats.get("num_blocks_total", 0))
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.get("prefix_cache_queries", 0),
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.get("prefix_cache_hits", 0)
        )
        yield counter("vllm:num_preemptions", "Preempted requests.", stats.get("num_preemptions", 0))


@dataclass(frozen=True)
class RequestTimes:
    """One finished request on its decode worker, in time.monotonic() seconds."""

    arrival: float
    scheduled: float | None  # first admitted; None: finished (aborted) while queued
    first_token: float | None
    finished: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    finished_reason: str


class WorkerMetrics:
    """A prefill/decode worker's metrics; latency observations come from its servicer."""

    def __init__(self, model_name: str, worker_id: str, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "worker_id": worker_id}
        self.registry.register(_EngineStatsCollector(stats, labels))
        self._labels = labels
        names = list(labels)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Arrival to first admission.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "First admission to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "First admission to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "max_tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = Counter(
            "vllm:request_success", "Finished requests by reason.", [*names, "finished_reason"], registry=self.registry
        )
        self.prefills = counter("moemesh:prefills", "Prompts prefilled for a decode worker (prefill role).")
        self.kv_bytes = Counter(
            "moemesh:kv_transfer_bytes",
            "KV bytes received from / sent to peers.",
            [*names, "direction"],
            registry=self.registry,
        )
        self.kv_seconds = histogram("moemesh:kv_transfer_seconds", "Duration of one KV transfer.", LATENCY_BUCKETS)
        self.kv_resumed_tokens = counter(
            "moemesh:kv_transfer_resumed_tokens",
            "Prompt tokens whose KV a failed remote prefill had delivered, kept by the "
            "local prefill that resumed after them (decode role).",
        )
        self.ttft_window = LatencyWindow()
        self.itl_window = LatencyWindow()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.ttft_window.add(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.itl_window.add(seconds)

    def request_finished(self, t: RequestTimes) -> None:
        self.e2e.observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue.observe(t.scheduled - t.arrival)
            self.inference.observe(t.finished - t.scheduled)
            if t.first_token is not None:
                self.prefill.observe(t.first_token - t.scheduled)
        if t.first_token is not None:
            self.decode.observe(t.finished - t.first_token)
        self.request_prompt_tokens.observe(t.num_prompt_tokens)
        self.request_generation_tokens.observe(t.num_generation_tokens)
        self.request_max_tokens.observe(t.max_tokens)
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.generation_tokens.inc(t.num_generation_tokens)
        self.success.labels(**self._labels, finished_reason=t.finished_reason).inc()

    def count_kv_bytes(self, direction: str, num_bytes: int) -> None:
        """KV bytes as each piece of a transfer is sent ('sent') or received ('received')."""
        self.kv_bytes.labels(**self._labels, direction=direction).inc(num_bytes)

    def observe_kv_transfer(self, seconds: float) -> None:
        self.kv_seconds.observe(seconds)


class RouterMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = list(labels)
        self.ttft = Histogram(
            "moemesh:router_time_to_first_token_seconds",
            "TTFT seen by the router.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.itl = Histogram(
            "moemesh:router_inter_token_latency_seconds",
            "Inter-token latency seen by the router.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.requests = Counter(
            "moemesh:router_requests", "Requests by outcome.", [*names, "outcome"], registry=self.registry
        )
        self.routed = Counter(
            "moemesh:router_routed",
            "Requests routed per worker and role.",
            [*names, "worker_id", "role"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "vllm:num_requests_running", "Requests in flight through the router.", names, registry=self.registry
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "moemesh:router_prompt_tokens", "Prompt tokens routed.", names, registry=self.registry
        ).labels(**labels)
        self.cached_tokens = Counter(
            "moemesh:router_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache.",
            names,
            registry=self.registry,
        ).labels(**labels)
        self.migrations = Counter(
            "moemesh:router_migrations",
            "Requests resumed on another decode worker mid-stream.",
            names,
            registry=self.registry,
        ).labels(**labels)
        self.redis_up = Gauge(
            "moemesh:router_redis_up", "1 while Redis answers.", names, registry=self.registry
        ).labels(**labels)
        self.decision_seconds = Histogram(
            "moemesh:router_decision_seconds",
            "Routing decision time.",
            names,
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2),
            registry=self.registry,
        ).labels(**labels)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(**self._labels, outcome=outcome).inc()

    def route(self, worker_id: str, role: str) -> None:
        self.routed.labels(**self._labels, worker_id=worker_id, role=role).inc()


class _ExpertTokensCollector:
    """Tokens per (layer, logical expert) since start and the placement version, read at scrape time."""

    def __init__(self, state: Callable[[], tuple], labels: dict[str, str]):
        self._state = state  # () -> (total_counts [num_layers, num_experts], active placement version)
        self._labels = labels

    def collect(self):
        counts, version = self._state()
        names, values = list(self._labels), list(self._labels.values())
        tokens = CounterMetricFamily(
            "moemesh:expert_tokens",
            "Tokens computed per (MoE layer, logical expert).",
            labels=[*names, "layer", "expert"],
        )
        for layer, expert in zip(*counts.nonzero()):
            tokens.add_metric([*values, str(layer), str(expert)], float(counts[layer, expert]))
        yield tokens
        placement = GaugeMetricFamily(
            "moemesh:expert_placement_version", "Active placement version held (0: none).", labels=names
        )
        placement.add_metric(values, float(version))
        yield placement


class ExpertMetrics:
    """An expert worker's metrics: RunExperts calls and their latency (observed by the servicer),
    tokens per (layer, expert) and the placement version (read at scrape time)."""

    def __init__(self, model_name: str, worker_id: str, state: Callable[[], tuple]):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "worker_id": worker_id}
        self._labels = labels
        names = list(labels)
        self.registry.register(_ExpertTokensCollector(state, labels))
        self.calls = Counter(
            "moemesh:expert_calls", "RunExperts calls by gRPC status.", [*names, "code"], registry=self.registry
        )
        self.latency = Histogram(
            "moemesh:expert_call_seconds",
            "Time to answer one RunExperts call.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

    def call(self, code: str, seconds: float | None = None) -> None:
        self.calls.labels(**self._labels, code=code).inc()
        if seconds is not None:
            self.latency.observe(seconds)
