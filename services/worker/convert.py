"""proto <-> engine translation shared by the worker servicers and the KV transport (no logic
beyond mapping). Only workers import it: the router and the operator use the contracts alone."""

from __future__ import annotations

from moemesh.engine.connectors.kv_transfer import KVLayout
from moemesh.engine.core.request import Logprob
from moemesh.engine.errors import InvalidRequestError
from moemesh.engine.sampling_params import SamplingParams, StructuredOutputSpec
from moemesh.proto.v1 import common_pb2, prefill_pb2, telemetry_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (-> INVALID_ARGUMENT) on out-of-range values."""
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        structured_output=structured_from_proto(p.structured_output) if p.HasField("structured_output") else None,
    )


def structured_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutputSpec:
    kind = p.WhichOneof("kind")
    if kind == "choice":
        return StructuredOutputSpec("choice", choices=tuple(p.choice.choices))
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind is None:
        raise InvalidRequestError("structured_output names no constraint", param="response_format")
    return StructuredOutputSpec("json" if kind == "json_schema" else kind, getattr(p, kind))


def logprob_to_proto(lp: Logprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top), top_logprobs=list(lp.top.values())
    )


def logprob_from_proto(p: common_pb2.TokenLogprob) -> Logprob:
    return Logprob(p.token_id, p.logprob, dict(zip(p.top_token_ids, p.top_logprobs)))


def layout_to_proto(layout: KVLayout) -> prefill_pb2.KVLayout:
    return prefill_pb2.KVLayout(
        dtype=layout.dtype,
        model_id=layout.model_id,
        tensors=[prefill_pb2.CacheTensorLayout(token_shape=list(s)) for s in layout.token_shapes],
    )


def layout_from_proto(p: prefill_pb2.KVLayout) -> KVLayout:
    return KVLayout(p.model_id, p.dtype, tuple(tuple(t.token_shape) for t in p.tensors))


def load_report(stats: dict, worker_id: str, role: str, metrics) -> telemetry_pb2.LoadReport:
    """A worker's load (engine stats + its metrics' latency windows) as the GetLoad reply."""
    return telemetry_pb2.LoadReport(
        worker_id=worker_id,
        role=role,
        num_waiting=stats.get("num_waiting", 0),
        num_running=stats.get("num_running", 0),
        num_waiting_for_kv=stats.get("num_waiting_for_kv", 0),
        num_blocks_total=stats.get("num_blocks_total", 0),
        num_blocks_used=stats.get("num_blocks_used", 0),
        kv_usage=stats.get("kv_usage", 0.0),
        prefix_cache_queries=stats.get("prefix_cache_queries", 0),
        prefix_cache_hits=stats.get("prefix_cache_hits", 0),
        num_preemptions=stats.get("num_preemptions", 0),
        ttft_p90_s=metrics.ttft_window.quantile(0.9),
        itl_p90_s=metrics.itl_window.quantile(0.9),
        num_kv_exports_held=stats.get("num_kv_held", 0),
    )
