"""The remote ExpertExecutor of prefill/decode workers: a MoE layer's routed experts run on the
expert workers that hold their replicas.

Per layer: logical ids -> replicas by the placement's round-robin rule
(`ExpertPlacement.replica_ids`), entries grouped by owning worker (`dispatch_plan`), one
RunExperts call per worker, all in flight at once, then the outputs combined with the gate
weights in float32. A worker that fails (unreachable, timed out, or without the placement loaded)
is marked down for `retry_s`: its entries are re-dispatched to other replicas of the same experts
at once, and later layers route around it until it is retried. When some needed expert has no
replica on a live worker the layer fails with `ExpertUnavailableError` naming the worker and the
experts. `on_error="raise"` (offline use) raises it from the forward; `"record"` (a serving
worker) keeps it for `take_error()` and returns zeros for the rest of that forward, so the step
ends with the engine's state consistent (execution overlap may have the next round in flight);
the worker then fails the step's requests with the error and drops its outputs.

Placement switch: `set_placement` (the worker, between steps) only stores the next placement;
the forward adopts it at MoE layer 0, so all layers of one forward use one placement even when
the model runs on another thread than the one that switches (execution overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from moemesh.common.placement import Placement
from moemesh.engine.errors import ExpertUnavailableError
from moemesh.engine.layers.expert_executor import ExpertExecutor, ExpertPlacement
from moemesh.expert.dispatch_plan import WorkerBatch, combine, gather_rows, group_by_worker, reroute, sort_entries
from moemesh.expert.transport import ExpertCallError, ExpertTransport
from moemesh.expert.wire import WireError, tensor_from_proto, tensor_to_proto
from moemesh.proto.v1 import expert_pb2


class RemotePlacement(ExpertPlacement):
    """An ExpertPlacement plus who owns each slot (from a services/common Placement)."""

    def __init__(self, placement: Placement):
        super().__init__(torch.tensor(np.array(placement.phy2log)), placement.num_experts, placement.version)
        self.worker_ids: tuple[str, ...] = placement.worker_ids
        self.slot_owner = np.array(placement.slot_owner)  # [num_slots]
        self.phy2log_np = np.array(placement.phy2log)  # [num_layers, num_slots]
        self.log2phy_np = np.array(placement.log2phy)  # [num_layers, num_experts, max_replicas]
        self.replica_counts_np = np.array(placement.replica_counts)  # [num_layers, num_experts]


class RemoteExpertExecutor(ExpertExecutor):
    def __init__(
        self,
        transport: ExpertTransport,
        placement: RemotePlacement,
        timeout_s: float = 10.0,
        retry_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_error: str = "raise",
    ):
        if on_error not in ("raise", "record"):
            raise ValueError(f"on_error must be 'raise' or 'record', got {on_error!r}")
        self.on_error = on_error
        self._error: ExpertUnavailableError | None = None  # recorded, not yet taken
        self._failed_forward = False  # this forward already failed: skip its remaining layers
        self.transport = transport
        self.placement = placement
        self.timeout_s, self.retry_s, self.clock = timeout_s, retry_s, clock
        self._next: RemotePlacement | None = None
        self._down_until: dict[str, float] = {}  # worker id -> monotonic time it is retried
        self.num_rerouted_entries = 0  # entries moved off a failed worker (tests, metrics)
        self.num_bytes_sent = 0
        self.num_bytes_received = 0

    # -- the worker, between steps ---------------------------------------------------------
    def set_placement(self, placement: ExpertPlacement) -> None:
        if not isinstance(placement, RemotePlacement):
            raise TypeError("a remote executor needs a RemotePlacement (it says which worker owns each slot)")
        current = self._next or self.placement
        if (placement.num_layers, placement.num_experts) != (current.num_layers, current.num_experts):
            raise ValueError(
                f"placement {placement.version} covers {placement.num_layers} MoE layers x {placement.num_experts} "
                f"experts, the model has {current.num_layers} x {current.num_experts}"
            )
        self._next = placement

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        self.transport.set_endpoints(endpoints)

    @property
    def version(self) -> int:
        """The version the next forward uses."""
        return (self._next or self.placement).version

    # -- the model, once per MoE layer -----------------------------------------------------
    def take_error(self) -> Exception | None:
        error, self._error = self._error, None
        return error

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        if layer == 0:
            self._failed_forward = False
            if self._next is not None:
                self.placement, self._next = self._next, None
        if self._failed_forward:
            return torch.zeros_like(hidden_states)
        try:
            return self._forward(layer, hidden_states, topk_ids, topk_weights)
        except ExpertUnavailableError as e:
            if self.on_error == "raise":
                raise
            self._error, self._failed_forward = e, True
            return torch.zeros_like(hidden_states)

    def _forward(self, layer, hidden_states, topk_ids, topk_weights):
        placement = self.placement
        num_tokens = hidden_states.shape[0]
        if num_tokens == 0:
            return torch.zeros_like(hidden_states)
        replica_ids = placement.replica_ids(layer, topk_ids).cpu().numpy()  # [num_tokens, top_k]
        entries = sort_entries(replica_ids, topk_ids.cpu().numpy())
        replicas = entries.replicas
        slot_down = self._slot_down(placement)
        if slot_down.any():  # route around workers that failed recently (stranded entries try anyway)
            replicas, _ = reroute(replicas, entries.experts, slot_down, placement.log2phy_np[layer],
                                  placement.replica_counts_np[layer])  # fmt: skip
        x = hidden_states.detach().cpu()  # [num_tokens, hidden]
        outputs = torch.empty(replicas.size, x.shape[1], dtype=x.dtype)  # [num_entries, hidden], sorted order
        positions = np.arange(replicas.size)
        batches = group_by_worker(replicas, entries.experts, entries.tokens, positions, placement.slot_owner)
        for _ in range(len(placement.worker_ids)):  # each round marks at least one more worker down
            failed = self._run(layer, placement, x, batches, outputs)
            if not failed:
                break
            batches = self._redispatch(layer, placement, entries, replicas, failed)
        else:
            raise ExpertUnavailableError(f"MoE layer {layer}: no expert worker answered after re-dispatching")
        out = combine(outputs, entries, topk_weights.cpu(), num_tokens, hidden_states.dtype)
        return out.to(hidden_states.device)

    def _run(self, layer, placement: RemotePlacement, x, batches: list[WorkerBatch], outputs) -> list:
        calls = []
        for batch in batches:
            request = expert_pb2.RunExpertsRequest(
                layer=layer, placement_version=placement.version,
                hidden_states=tensor_to_proto(gather_rows(x, batch.token_ids)),
                groups=[expert_pb2.ReplicaGroup(slot=int(s), expert=int(e), num_rows=int(n))
                        for s, e, n in zip(batch.slots, batch.experts, batch.group_sizes)],
                row_ids=batch.row_ids.tolist(),
            )  # fmt: skip
            self.num_bytes_sent += len(request.hidden_states.data)
            calls.append((batch, self.transport.submit(placement.worker_ids[batch.worker], request, self.timeout_s)))
        failed = []
        for batch, call in calls:
            worker_id = placement.worker_ids[batch.worker]
            try:
                reply = call.result()
                y = tensor_from_proto(reply.outputs, "outputs", ndim=2)
                if tuple(y.shape) != (batch.num_entries, x.shape[1]):
                    raise WireError(f"outputs have shape {list(y.shape)}, expected {[batch.num_entries, x.shape[1]]}")
            except (ExpertCallError, WireError) as e:
                failed.append((batch, e))
                self._down_until[worker_id] = self.clock() + self.retry_s
                continue
            self.num_bytes_received += len(reply.outputs.data)
            self._down_until.pop(worker_id, None)
            outputs[torch.from_numpy(batch.positions)] = y.to(x.dtype)
        return failed

    def _redispatch(self, layer, placement: RemotePlacement, entries, replicas, failed) -> list[WorkerBatch]:
        positions = np.concatenate([batch.positions for batch, _ in failed])
        moved, stranded = reroute(replicas[positions], entries.experts[positions], self._slot_down(placement),
                                  placement.log2phy_np[layer], placement.replica_counts_np[layer])  # fmt: skip
        if stranded:
            errors = "; ".join(str(e) for _, e in failed)
            raise ExpertUnavailableError(
                f"MoE layer {layer}: {errors}; experts {stranded} have no replica on a live expert worker "
                f"(placement {placement.version})"
            )
        replicas[positions] = moved
        self.num_rerouted_entries += int(positions.size)
        return group_by_worker(moved, entries.experts[positions], entries.tokens[positions], positions,
                               placement.slot_owner)  # fmt: skip

    def _slot_down(self, placement: RemotePlacement) -> np.ndarray:  # [num_slots] bool
        now = self.clock()
        down = np.array([self._down_until.get(w, 0.0) > now for w in placement.worker_ids])
        return down[placement.slot_owner]

    def close(self) -> None:
        self.transport.close()
