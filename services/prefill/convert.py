"""proto <-> engine translation shared by the worker servicers (no logic beyond mapping)."""

from __future__ import annotations

from moemesh.engine.kv_transfer import KVLayout
from moemesh.engine.request import Logprob
from moemesh.engine.sampling_params import SamplingParams
from moemesh.proto.v1 import common_pb2, prefill_pb2

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
    )


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
