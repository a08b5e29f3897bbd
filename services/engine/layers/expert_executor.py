"""Where a MoE layer's routed experts run: the seam between gating and the expert FFNs.

`ExpertExecutor` takes one MoE layer's hidden states and its gating result (logical expert ids
and weights) and returns the combined routed output y[t] = sum_j w[t, j] * E_{ids[t, j]}(x[t]).
`LocalExpertExecutor` runs the experts in this process. A remote executor (the expert-service
issue) implements the same interface by grouping tokens per expert worker and sending one RPC
per worker per layer.

Placement (logical expert -> physical replicas) is applied here. `ExpertPlacement` is this
process's view of one version of services/common/placement.Placement: per MoE layer the
`phy2log` table ([num_moe_layers, num_replicas]: the logical expert each replica holds; a
replica is Placement's "slot"), the derived `replica_counts` and `log2phy` (same definitions as
Placement's). Worker ownership (`slot_owner`, `worker_ids`) is what a remote executor adds; the
local one owns every replica. Layer indices are MoE-layer ordinals (0 = the model's first MoE
layer), as in the load counters.

Asynchronous use (ping-pong micro-batch overlap, models/decoder_model.py): `submit` starts a
layer's experts and returns an `ExpertHandle` at once; `wait` returns the combined output. The
stack runs the other micro-batch's attention in between. The default `submit` runs `forward`
synchronously (the local executor: nothing to overlap); a remote executor starts its per-worker
calls in `submit` and gathers them in `wait`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from moemesh import kernels


class ExpertWeights(Protocol):
    w13: torch.Tensor  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor  # [num_experts, hidden, intermediate]
    # block-FP8 experts (layers/moe.RoutedExperts.use_fp8) also have fp8_block (block_n, block_k),
    # w13_scale_inv [num_experts, 2 * ceil(I / bn), ceil(H / bk)], w2_scale_inv [num_experts, ceil(H / bn), ceil(I / bk)]


def expert_tensors(experts: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """(w13, w2), or (w13, w13_scale_inv, w2, w2_scale_inv) for block-FP8 experts: the weight
    arguments of `kernels.fused_moe` / `kernels.fp8_fused_moe`, in their order."""
    if getattr(experts, "fp8_block", None) is None:
        return experts.w13, experts.w2
    return experts.w13, experts.w13_scale_inv, experts.w2, experts.w2_scale_inv


def run_experts(
    hidden_states: torch.Tensor,  # [num_tokens, hidden]
    tensors: tuple[torch.Tensor, ...],  # expert_tensors(...), rows indexed by replica_ids
    fp8_block: tuple[int, int] | None,
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    replica_ids: torch.Tensor,  # [num_tokens, top_k] int64
) -> torch.Tensor:  # [num_tokens, hidden]
    if fp8_block is None:
        return kernels.fused_moe(hidden_states, *tensors, topk_weights, replica_ids)
    return kernels.fp8_fused_moe(hidden_states, *tensors, topk_weights, replica_ids, fp8_block)


class ExpertPlacement:
    """Logical expert -> replicas for each MoE layer; every expert has at least one replica.

    Replica choice rule: the entries (token, slot) routed to expert e in one call are ranked in
    token order, and the r-th goes to replica log2phy[layer, e, r % replica_counts[layer, e]] —
    an even round-robin over the expert's replicas, deterministic for a given batch.
    """

    def __init__(self, phy2log: torch.Tensor, num_experts: int, version: int = 0):
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64, device="cpu")  # [num_layers, num_replicas]
        if phy2log.dim() != 2 or phy2log.numel() == 0:
            raise ValueError(f"phy2log must be a non-empty [num_layers, num_replicas] table, got {list(phy2log.shape)}")
        if bool(((phy2log < 0) | (phy2log >= num_experts)).any()):
            raise ValueError(f"phy2log holds experts outside 0..{num_experts - 1}")
        num_layers, num_replicas = phy2log.shape
        offsets = torch.arange(num_layers, device="cpu")[:, None] * num_experts
        counts = torch.bincount((phy2log + offsets).flatten(), minlength=num_layers * num_experts)
        counts = counts.view(num_layers, num_experts)  # [num_layers, num_experts]
        if bool((counts == 0).any()):
            layer, expert = (counts == 0).nonzero()[0].tolist()
            raise ValueError(f"expert {expert} has no replica in MoE layer {layer}")
        max_replicas = int(counts.max())
        log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64, device="cpu")
        for layer in range(num_layers):
            order = torch.argsort(phy2log[layer], stable=True)  # replicas grouped by expert
            experts = phy2log[layer, order]
            rank = torch.arange(num_replicas, device="cpu") - torch.searchsorted(experts, experts)
            log2phy[layer, experts, rank] = order
        self.version, self.num_experts = version, num_experts
        self.phy2log, self.replica_counts, self.log2phy = phy2log, counts, log2phy
        self._device_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.is_identity = num_replicas == num_experts and bool(
            (phy2log == torch.arange(num_experts, device="cpu")).all()
        )

    @classmethod
    def identity(cls, num_layers: int, num_experts: int) -> ExpertPlacement:
        """One replica per expert, replica id = expert id (the single-process default)."""
        return cls(torch.arange(num_experts, device="cpu").repeat(num_layers, 1), num_experts)

    @classmethod
    def from_placement(cls, placement) -> ExpertPlacement:
        """From a services/common/placement.Placement (duck-typed: phy2log, num_experts, version)."""
        phy2log = torch.tensor(np.array(placement.phy2log, dtype=np.int64), device="cpu")  # a writable copy
        return cls(phy2log, placement.num_experts, placement.version)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_replicas(self) -> int:
        return self.phy2log.shape[1]

    def replica_ids(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, top_k]
        """Map logical ids [num_tokens, top_k] to replica ids by the round-robin rule; on the
        ids' device, without a host sync."""
        if self.is_identity:
            return topk_ids
        device = topk_ids.device
        log2phy, counts = self._tables_on(device)
        log2phy, counts = log2phy[layer], counts[layer]  # [num_experts, max_replicas], [num_experts]
        flat_ids = topk_ids.reshape(-1)  # [num_entries]
        order = torch.argsort(flat_ids, stable=True)
        sorted_ids = flat_ids[order]
        rank = torch.empty_like(flat_ids)
        rank[order] = torch.arange(flat_ids.numel(), device=device) - torch.searchsorted(sorted_ids, sorted_ids)
        replicas = log2phy[flat_ids, rank % counts[flat_ids]]
        return replicas.view_as(topk_ids)

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._device_tables:  # copied once per device, not every step
            self._device_tables[device] = (self.log2phy.to(device), self.replica_counts.to(device))
        return self._device_tables[device]


class ExpertHandle:
    """An in-flight `submit`; only the executor that made it reads it (in `wait`)."""


class CompletedExperts(ExpertHandle):
    """The default `submit`'s handle: the output, already computed."""

    def __init__(self, output: torch.Tensor):  # [num_tokens, hidden]
        self.output = output


class ExpertExecutor(ABC):
    """Runs the routed experts of one MoE layer for one step's tokens.

    Callers:
    - `forward`: the MoE layer (SparseMoE), once per MoE layer per model forward (step), after
      gating, with logical expert ids;
    - `submit` / `wait`: instead of `forward` when a step runs as two micro-batches
      (SparseMoE.start / finish): per MoE layer and micro-batch one `submit`, then, after the
      other micro-batch's attention, one `wait` on its handle. Handles of both micro-batches (and
      of two consecutive layers) may be in flight at once; each is waited exactly once, in
      submission order per micro-batch;
    - `set_placement`: the worker, between steps, when a new placement version becomes current
      (never during a forward, so one step sees one placement).
    """

    @abstractmethod
    def forward(
        self,
        layer: int,  # MoE-layer ordinal
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int64, logical experts
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    ) -> torch.Tensor:  # [num_tokens, hidden]: sum_j topk_weights[t, j] * E_{topk_ids[t, j]}(x[t])
        ...

    # True when `submit` returns before the experts have run (remote experts): the model runner
    # then splits rounds into two micro-batches by default (ModelConfig.micro_batch_overlap None).
    overlaps_submit: bool = False

    def submit(
        self,
        layer: int,  # MoE-layer ordinal
        hidden_states: torch.Tensor,  # [num_tokens, hidden]
        topk_ids: torch.Tensor,  # [num_tokens, top_k] int64, logical experts
        topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    ) -> ExpertHandle:
        """Start the layer's experts; by default run them now (`forward`)."""
        return CompletedExperts(self.forward(layer, hidden_states, topk_ids, topk_weights))

    def wait(self, handle: ExpertHandle) -> torch.Tensor:  # [num_tokens, hidden], as `forward` returns
        assert isinstance(handle, CompletedExperts), f"{type(self).__name__} got a foreign handle"
        return handle.output

    @abstractmethod
    def set_placement(self, placement: ExpertPlacement) -> None: ...

    def take_error(self) -> Exception | None:
        """An error a forward recorded instead of raising since the last call, cleared (a remote
        executor whose experts were unreachable: that forward's output is garbage). Caller: the
        worker's engine thread after every step. The local executor never fails."""
        return None


class LocalExpertExecutor(ExpertExecutor):
    """Experts in this process. Tokens are grouped by replica inside `kernels.fused_moe` (a
    counting sort + one grouped GEMM pair on CUDA; one matmul pair per active replica in the
    torch reference): no per-token loop.

    With a non-identity placement each replica is a real copy of its expert's weights (made on
    first use and kept until the placement or the weights change), so replicas can be balanced
    exactly as a remote placement would; with the identity placement the layer's own weights are
    used in place.
    """

    def __init__(self, experts: Sequence[ExpertWeights], placement: ExpertPlacement | None = None):
        self.experts = list(experts)  # one per MoE layer; read at call time (weights may move device)
        num_experts = self.experts[0].w13.shape[0] if self.experts else 0
        self.placement = placement or ExpertPlacement.identity(max(1, len(self.experts)), max(1, num_experts))
        self._check(self.placement)
        self._replica_weights: dict[int, tuple] = {}  # layer -> (key, *replica tensors)
        if self.experts and self.experts[0].w13.device.type == "cpu":
            kernels.build_grouped_moe_kernel()  # the CPU expert kernel, built now, not in the first MoE layer

    def set_placement(self, placement: ExpertPlacement) -> None:
        self._check(placement)
        self.placement = placement
        self._replica_weights.clear()

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        replica_ids = self.placement.replica_ids(layer, topk_ids)  # [num_tokens, top_k]
        fp8_block = getattr(self.experts[layer], "fp8_block", None)
        return run_experts(hidden_states, self._weights(layer), fp8_block, topk_weights, replica_ids)

    def _weights(self, layer: int) -> tuple[torch.Tensor, ...]:  # expert_tensors, one row per replica
        experts = self.experts[layer]
        if experts.w13.shape[0] == 0:
            raise RuntimeError(
                "this model was loaded without its routed expert weights "
                "(load_routed_experts=False): install a remote ExpertExecutor first"
            )
        tensors = expert_tensors(experts)
        if self.placement.is_identity:
            return tensors
        key = (experts.w13.data_ptr(), experts.w2.data_ptr(), experts.w13.dtype, experts.w13.device)
        cached = self._replica_weights.get(layer)
        if cached is None or cached[0] != key:
            phy2log = self.placement.phy2log[layer].to(experts.w13.device)  # [num_replicas]
            # each [num_replicas, ...]: the expert rows (and their FP8 scales) copied per replica
            cached = self._replica_weights[layer] = (key, *(t.detach().index_select(0, phy2log) for t in tensors))
        return cached[1:]

    def _check(self, placement: ExpertPlacement) -> None:
        if self.experts and (placement.num_layers, placement.num_experts) != (
            len(self.experts),
            self.experts[0].w13.shape[0],
        ):
            raise ValueError(
                f"placement covers {placement.num_layers} MoE layers x {placement.num_experts} experts, "
                f"the model has {len(self.experts)} x {self.experts[0].w13.shape[0]}"
            )
