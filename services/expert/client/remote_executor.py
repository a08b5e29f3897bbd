"""The remote ExpertExecutor of prefill/decode workers: a MoE layer's routed experts run on the
expert workers that hold their replicas.

Per layer: logical ids -> replicas by the placement's round-robin rule
(`ExpertPlacement.replica_ids`), entries grouped by owning worker (`dispatch_plan.plan_layer`:
both in one C call where a compiler is found), one request
per worker through the ExpertTransport, all in flight at once. Each token's hidden state goes
once to each worker it needs, with its (replica, gate weight) entries there; the worker combines
its own experts and returns one float32 partial [num_tokens_w, hidden]; the partials are added
here in worker order and cast once (when one worker serves every entry it casts its partial
itself: `outputs_in_input_dtype`, half the reply bytes for bf16). Versus the local kernel (one float32 sum over all of a
token's entries in replica order) only the association of the float32 sum changes: fp32 outputs
differ by a few ulps (|rel| ~ 1e-7), bf16 outputs round the same float32 sum once (rarely 1 ulp).
A worker that fails (unreachable, timed out, or without the placement loaded)
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

After each layer's submit the executor hands the transport a rehearsal of it (the planning and
the requests again, nothing sent: `ExpertTransport.set_rehearsal`); a transport that busy-polls for
the replies (socket) runs it while it waits, so that path's caches stay warm.

Ping-pong micro-batches: `submit` sends a layer's per-worker requests and returns; `wait`
gathers the replies (re-dispatching after a failure, synchronously) and combines them. A layer-0
`submit` starts a new forward only when nothing is in flight (the second micro-batch's layer 0
follows the first's submit without a wait), so both micro-batches see one placement.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from moemesh import kernels
from moemesh.contracts.placement import Placement
from moemesh.engine.errors import ExpertUnavailableError
from moemesh.engine.layers.expert_executor import CompletedExperts, ExpertExecutor, ExpertHandle, ExpertPlacement
from moemesh.expert.client.dispatch_plan import WorkerBatch, gather_rows, group_by_worker, plan_layer, reroute
from moemesh.expert.protocol.call import ExpertRequest
from moemesh.expert.protocol.wire import WireError
from moemesh.expert.transports.base import ExpertCallError, ExpertTransport


class RemotePlacement(ExpertPlacement):
    """An ExpertPlacement plus who owns each slot (from a services/common Placement)."""

    def __init__(self, placement: Placement):
        super().__init__(torch.tensor(np.array(placement.phy2log)), placement.num_experts, placement.version)
        self.worker_ids: tuple[str, ...] = placement.worker_ids
        self.slot_owner = np.array(placement.slot_owner)  # [num_slots]
        self.phy2log_np = np.array(placement.phy2log)  # [num_layers, num_slots]
        self.log2phy_np = np.array(placement.log2phy)  # [num_layers, num_experts, max_replicas]
        self.replica_counts_np = np.array(placement.replica_counts)  # [num_layers, num_experts]
        self._layer_tables: dict[int, kernels.LayerTables] = {}

    def layer_tables(self, layer: int) -> kernels.LayerTables:
        """The layer as the dispatch planner reads it (built on first use)."""
        tables = self._layer_tables.get(layer)
        if tables is None:
            log2phy = None if self.is_identity else self.log2phy_np[layer]
            tables = kernels.LayerTables.build(log2phy, self.replica_counts_np[layer], self.slot_owner)
            self._layer_tables[layer] = tables
        return tables

    def plan(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """`dispatch_plan.plan_layer` of this placement's layer for CPU ids and gate weights."""
        return plan_layer(self.layer_tables(layer), lambda: self.replica_ids(layer, topk_ids), topk_ids, topk_weights)


class _RemoteHandle(ExpertHandle):
    """One layer's calls in flight: what `wait` needs to gather, re-dispatch and combine."""

    def __init__(self, layer, placement, entries, replicas, x, weights, batches, calls, out, like):
        self.layer, self.placement, self.entries, self.replicas = layer, placement, entries, replicas
        self.x, self.weights, self.batches, self.calls = x, weights, batches, calls
        self.out = out  # [num_tokens, hidden] float32, the sum of the partials (None until the first reply)
        self.out_is_reply = False  # out is a reply's own tensor (not ours to write or return)
        self.like = like  # the layer input: output device and dtype


def _request(layer: int, placement: RemotePlacement, x, weights, batch: WorkerBatch, sole: bool) -> ExpertRequest:
    rows = x if batch.token_ids.size == x.shape[0] else gather_rows(x, batch.token_ids)  # all tokens: as is
    entry_weights = weights[slice(*batch.span)] if batch.span else weights[torch.from_numpy(batch.positions)]
    return ExpertRequest(
        layer,
        placement.version,
        rows,
        batch.slots.astype(np.int32, copy=False),
        batch.experts.astype(np.int32, copy=False),
        batch.group_sizes.astype(np.int32, copy=False),
        batch.row_ids.astype(np.int32, copy=False),
        entry_weights,
        outputs_in_input_dtype=sole,
    )


class RemoteExpertExecutor(ExpertExecutor):
    overlaps_submit = True

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
        self.compute_s = 0.0  # per layer the slowest worker's compute, summed (the rest is dispatch overhead)
        self._num_in_flight = 0  # submitted, not yet waited handles
        kernels.build_expert_dispatch_kernel()  # built (or found in its cache) now, not in the first MoE layer

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
        return self.wait(self.submit(layer, hidden_states, topk_ids, topk_weights))

    def submit(self, layer, hidden_states, topk_ids, topk_weights) -> ExpertHandle:
        if layer == 0 and self._num_in_flight == 0:  # a new forward
            self._failed_forward = False
            if self._next is not None:
                self.placement, self._next = self._next, None
        if self._failed_forward or hidden_states.shape[0] == 0:
            return CompletedExperts(torch.zeros_like(hidden_states))
        handle = self._submit(layer, hidden_states, topk_ids, topk_weights)
        self._num_in_flight += 1
        return handle

    def wait(self, handle: ExpertHandle) -> torch.Tensor:
        if isinstance(handle, CompletedExperts):
            return handle.output
        assert isinstance(handle, _RemoteHandle), "a handle of another executor"
        self._num_in_flight -= 1
        if self._failed_forward:  # an earlier layer (or the other micro-batch) failed: skip
            return torch.zeros_like(handle.like)
        try:
            return self._wait(handle)
        except ExpertUnavailableError as e:
            if self.on_error == "raise":
                self._num_in_flight = 0  # the forward ends here; the other micro-batch's calls are dropped
                raise
            self._error, self._failed_forward = e, True
            return torch.zeros_like(handle.like)

    def _submit(self, layer, hidden_states, topk_ids, topk_weights) -> _RemoteHandle:
        placement = self.placement
        num_tokens = hidden_states.shape[0]
        ids, cpu_weights = topk_ids.cpu(), topk_weights.detach().cpu()
        entries, weights, batches = placement.plan(layer, ids, cpu_weights)
        replicas = entries.replicas
        # route around workers that failed recently (stranded entries try anyway); none: no lookup
        slot_down = self._slot_down(placement) if self._down_until else None
        if slot_down is not None and slot_down.any():
            replicas, _ = reroute(
                replicas, entries.experts, slot_down, placement.log2phy_np[layer], placement.replica_counts_np[layer]
            )
            batches = group_by_worker(
                replicas, entries.experts, entries.tokens, np.arange(replicas.size), placement.slot_owner
            )
        x = hidden_states.detach().cpu()  # [num_tokens, hidden]
        # one worker serves every entry: its partial is the output, rounded to x's dtype over there
        sole = len(batches) == 1 and batches[0].token_ids.size == num_tokens and x.dtype != torch.float32
        calls = self._send(layer, placement, x, weights, batches, sole)
        # while the transport waits for the replies it may repeat this planning, to keep it warm
        self.transport.set_rehearsal(functools.partial(self._rehearse_submit, layer, placement, ids, cpu_weights, x))
        return _RemoteHandle(layer, placement, entries, replicas, x, weights, batches, calls, None, hidden_states)

    def _wait(self, h: _RemoteHandle) -> torch.Tensor:
        calls = h.calls
        for _ in range(len(h.placement.worker_ids)):  # each round marks at least one more worker down
            failed = self._gather(h, calls)
            if not failed:
                break
            batches = self._redispatch(h.layer, h.placement, h.entries, h.replicas, failed)
            calls = self._send(h.layer, h.placement, h.x, h.weights, batches)
        else:
            raise ExpertUnavailableError(f"MoE layer {h.layer}: no expert worker answered after re-dispatching")
        if h.out is None:  # no tokens were routed anywhere (cannot happen with top_k >= 1)
            h.out = torch.zeros(h.x.shape, dtype=torch.float32)
        return h.out.to(device=h.like.device, dtype=h.like.dtype, copy=h.out_is_reply)

    def _send(self, layer, placement: RemotePlacement, x, weights, batches: list[WorkerBatch], sole=False) -> list:
        """(batch, pending call, the outputs' dtype) per batch; `sole`: the one batch's partial is the output."""
        calls, dtype = [], x.dtype if sole else torch.float32
        for batch in batches:
            request = _request(layer, placement, x, weights, batch, sole)
            self.num_bytes_sent += request.hidden_states.nbytes + request.entry_weights.nbytes
            call = self.transport.submit(placement.worker_ids[batch.worker], request, self.timeout_s)
            calls.append((batch, call, dtype))
        return calls

    @staticmethod
    def _rehearse_submit(layer, placement: RemotePlacement, ids, cpu_weights, x) -> None:
        """`_submit`'s planning and requests again, sending nothing (ExpertTransport.set_rehearsal)."""
        _, weights, batches = placement.plan(layer, ids, cpu_weights)
        for batch in batches:
            _request(layer, placement, x, weights, batch, False)

    def _gather(self, h: _RemoteHandle, calls: list) -> list:
        """Adds each reply's partial into `h.out` (worker order); returns the failed calls. A
        first partial that covers every token becomes the sum itself (0 + y is y: same sum); the
        sole partial comes already rounded to x's dtype (the same rounding of the same sum)."""
        failed, slowest, num_tokens = [], 0.0, h.x.shape[0]
        for batch, call, dtype in calls:
            worker_id = h.placement.worker_ids[batch.worker]
            try:
                reply = call.result()
                y = reply.outputs
                expected = (batch.token_ids.size, h.x.shape[1])
                if tuple(y.shape) != expected or y.dtype != dtype:
                    raise WireError(f"outputs are {y.dtype} {list(y.shape)}, expected {dtype} {list(expected)}")
            except (ExpertCallError, WireError) as e:
                failed.append((batch, e))
                self._down_until[worker_id] = self.clock() + self.retry_s
                continue
            self.num_bytes_received += y.nbytes
            slowest = max(slowest, reply.compute_s)
            self._down_until.pop(worker_id, None)
            if h.out is None and batch.token_ids.size == num_tokens:  # a buffer the transport may reuse is
                h.out, h.out_is_reply = y, not reply.owned  # copied before it is returned or added to
                continue
            if h.out is None:
                h.out = torch.zeros(num_tokens, h.x.shape[1], dtype=torch.float32)
            elif h.out_is_reply:
                h.out, h.out_is_reply = h.out.clone(), False
            h.out.index_add_(0, torch.from_numpy(batch.token_ids), y)  # this worker's partial of each of its tokens
        self.compute_s += slowest
        return failed

    def _redispatch(self, layer, placement: RemotePlacement, entries, replicas, failed) -> list[WorkerBatch]:
        positions = np.concatenate([batch.positions for batch, _ in failed])
        moved, stranded = reroute(
            replicas[positions],
            entries.experts[positions],
            self._slot_down(placement),
            placement.log2phy_np[layer],
            placement.replica_counts_np[layer],
        )
        if stranded:
            errors = "; ".join(str(e) for _, e in failed)
            raise ExpertUnavailableError(
                f"MoE layer {layer}: {errors}; experts {stranded} have no replica on a live expert worker "
                f"(placement {placement.version})"
            )
        replicas[positions] = moved
        self.num_rerouted_entries += int(positions.size)
        return group_by_worker(
            moved, entries.experts[positions], entries.tokens[positions], positions, placement.slot_owner
        )

    def _slot_down(self, placement: RemotePlacement) -> np.ndarray:  # [num_slots] bool
        now = self.clock()
        down = np.array([self._down_until.get(w, 0.0) > now for w in placement.worker_ids])
        return down[placement.slot_owner]

    def close(self) -> None:
        self.transport.close()
