"""proto <-> engine translation shared by the worker servicers and the KV transport (no logic
beyond mapping). Only workers import it: the router and the operator use the contracts alone.
Sampling parameters and finish reasons are the contracts' (contracts/sampling_proto.py,
contracts/finish_reason.py), converted there for the router and the workers alike."""

from __future__ import annotations

from moemesh.engine.connectors.kv_transfer import KVLayout
from moemesh.engine.core.request import Logprob
from moemesh.proto.v1 import common_pb2, prefill_pb2, telemetry_pb2


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
