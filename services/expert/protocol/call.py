"""One expert call as the data plane carries it: the tensors and index arrays of a
RunExpertsRequest and its reply, independent of the transport.

`RemoteExpertExecutor` builds an `ExpertRequest` per expert worker and layer; an `ExpertTransport`
carries it (as a protobuf message over gRPC and torch-dist, as raw frames over the socket
transport: frames.py) and returns an `ExpertReply`; the worker's servicer checks and computes it
(`servicer.parse_call`). The field meanings are expert.proto's RunExpertsRequest/Response.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np
import torch

from moemesh.expert.protocol.wire import tensor_from_proto, tensor_to_proto
from moemesh.proto.v1 import expert_pb2


class CallError(Exception):
    """A RunExperts request this worker refuses; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class ExpertRequest:
    layer: int  # MoE-layer ordinal
    placement_version: int
    hidden_states: torch.Tensor  # [num_tokens, hidden] on the CPU: every token routed to this worker, once
    group_slots: np.ndarray  # [num_groups] int32 slot of each replica group, ascending
    group_experts: np.ndarray  # [num_groups] int32 logical expert the slot holds in this layer
    group_rows: np.ndarray  # [num_groups] int32 entries per group
    row_ids: np.ndarray  # [num_entries] int32 row of hidden_states per entry, group by group
    entry_weights: torch.Tensor | None = None  # [num_entries] float32: combine on the worker
    outputs_in_input_dtype: bool = False  # with entry_weights: the sole partial, rounded to x's dtype there


@dataclass
class ExpertReply:
    outputs: torch.Tensor  # with entry_weights: [num_tokens, hidden] float32 (or x's dtype); else [num_entries, hidden]
    compute_s: float = 0.0  # the worker's compute time for this request
    owned: bool = False  # nothing else holds the outputs' memory: the caller may keep or change them without a copy


def _int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def request_to_proto(request: ExpertRequest) -> expert_pb2.RunExpertsRequest:
    message = expert_pb2.RunExpertsRequest(
        layer=request.layer,
        placement_version=request.placement_version,
        hidden_states=tensor_to_proto(request.hidden_states),
        group_slots=request.group_slots.tolist(),
        group_experts=request.group_experts.tolist(),
        group_rows=request.group_rows.tolist(),
        row_ids=request.row_ids.tolist(),
        outputs_in_input_dtype=request.outputs_in_input_dtype,
    )
    if request.entry_weights is not None:
        message.entry_weights.CopyFrom(tensor_to_proto(request.entry_weights))
    return message


def request_from_proto(message: expert_pb2.RunExpertsRequest) -> ExpertRequest:
    """Raises WireError for tensors that do not describe themselves consistently."""
    weights = None
    if message.HasField("entry_weights"):
        weights = tensor_from_proto(message.entry_weights, "entry_weights", ndim=1)
    return ExpertRequest(
        message.layer,
        message.placement_version,
        tensor_from_proto(message.hidden_states, "hidden_states", ndim=2),
        _int32(message.group_slots),
        _int32(message.group_experts),
        _int32(message.group_rows),
        _int32(message.row_ids),
        weights,
        message.outputs_in_input_dtype,
    )


def reply_to_proto(reply: ExpertReply) -> expert_pb2.RunExpertsResponse:
    return expert_pb2.RunExpertsResponse(outputs=tensor_to_proto(reply.outputs), compute_s=reply.compute_s)


def reply_from_proto(message: expert_pb2.RunExpertsResponse) -> ExpertReply:
    """Raises WireError for outputs that do not describe themselves consistently."""
    return ExpertReply(tensor_from_proto(message.outputs, "outputs", ndim=2), message.compute_s)
