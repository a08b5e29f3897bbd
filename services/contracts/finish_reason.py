"""Why a request ended: one vocabulary for the engine, the workers' proto and the router.

`FinishReason` is a str enum, so a reason compares equal to (and serializes as) its value. The
proto enum is reached through the one mapping here; the router maps to OpenAI's strings
(router/openai_protocol.py).
"""

from __future__ import annotations

import enum

from moemesh.proto.v1 import common_pb2


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled (the client left, a draining worker gave it up)


_TO_PROTO: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FROM_PROTO: dict[int, FinishReason] = {value: reason for reason, value in _TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    """FINISH_REASON_UNSPECIFIED for None (not finished)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _TO_PROTO[FinishReason(reason)]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (not finished yet)."""
    return _FROM_PROTO.get(value)
