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


class ExpertExecutor(ABC):
    """Runs the routed experts of one MoE layer for one step's tokens.

    Callers:
    - `forward`: the MoE layer (SparseMoE), once per MoE layer per model forward (step), after
      gating, with logical expert ids;
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
        self._replica_weights: dict[int, tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def set_placement(self, placement: ExpertPlacement) -> None:
        self._check(placement)
        self.placement = placement
        self._replica_weights.clear()

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        replica_ids = self.placement.replica_ids(layer, topk_ids)  # [num_tokens, top_k]
        w13, w2 = self._weights(layer)
        return kernels.fused_moe(hidden_states, w13, w2, topk_weights, replica_ids)

    def _weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        experts = self.experts[layer]
        if experts.w13.shape[0] == 0:
            raise RuntimeError("this model was loaded without its routed expert weights "
                               "(load_routed_experts=False): install a remote ExpertExecutor first")  # fmt: skip
        if self.placement.is_identity:
            return experts.w13, experts.w2
        key = (experts.w13.data_ptr(), experts.w2.data_ptr(), experts.w13.dtype, experts.w13.device)
        cached = self._replica_weights.get(layer)
        if cached is None or cached[0] != key:
            phy2log = self.placement.phy2log[layer].to(experts.w13.device)  # [num_replicas]
            w13 = experts.w13.detach().index_select(0, phy2log)  # [num_replicas, 2 * intermediate, hidden]
            w2 = experts.w2.detach().index_select(0, phy2log)  # [num_replicas, hidden, intermediate]
            cached = self._replica_weights[layer] = (key, w13, w2)
        return cached[1], cached[2]

    def _check(self, placement: ExpertPlacement) -> None:
        if self.experts and (placement.num_layers, placement.num_experts) != (
            len(self.experts),
            self.experts[0].w13.shape[0],
        ):
            raise ValueError(
                f"placement covers {placement.num_layers} MoE layers x {placement.num_experts} experts, "
                f"the model has {len(self.experts)} x {self.experts[0].w13.shape[0]}"
            )
