"""An expert worker's replicas: per loaded placement version, the stacked weights of the slots it
owns in every MoE layer, and the tokens each replica served.

Callers:
- the worker's placement loop: `load(placement)` (in a thread; weights already held by another
  loaded version are copied from memory, only the others are read from the checkpoint),
  `release(version)` once a version is no longer needed;
- the servicer: `get(version)` per call, then `HostedVersion.run` on its compute thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moemesh.contracts.placement import Placement, PlacementError
from moemesh.engine.layers.expert_executor import run_experts
from moemesh.expert.server.weights import ExpertTensors, LayerExpert, MoEShape
from moemesh.kernels import grouped_moe


class HostedVersion:
    def __init__(
        self,
        placement: Placement,
        worker_id: str,
        weights: dict[LayerExpert, ExpertTensors],
        fp8_block: tuple[int, int] | None = None,  # (block_n, block_k) when the tensors are block-FP8
    ):
        self.placement = placement
        self.version = placement.version
        owned = worker_id in placement.worker_ids
        self.slots = placement.slots_of(worker_id) if owned else np.zeros(0, dtype=np.int64)  # [num_local]
        self.local_index = np.full(placement.num_slots, -1, dtype=np.int64)  # [num_slots] -> row of the stacks
        self.local_index[self.slots] = np.arange(self.slots.size)
        # per layer, the kernel's weight arguments (layers/expert_executor.expert_tensors), stacked per
        # local replica: (w13, w2), or block-FP8 (w13, w13_scale_inv, w2, w2_scale_inv)
        self.stacks: list[tuple[torch.Tensor, ...]] = []
        self.w13: list[torch.Tensor] = []  # per layer [num_local, 2 * intermediate, hidden]
        self.w2: list[torch.Tensor] = []  # per layer [num_local, hidden, intermediate]
        self.weights: dict[LayerExpert, ExpertTensors] = {}  # views into the stacks
        for layer in range(placement.num_layers if self.slots.size else 0):
            experts = placement.phy2log[layer, self.slots]
            per_replica = [weights[(layer, int(e))] for e in experts]
            stacks = tuple(torch.stack(parts) for parts in zip(*per_replica))
            self.stacks.append(stacks)
            self.w13.append(stacks[0])
            self.w2.append(stacks[-2] if len(stacks) == 4 else stacks[1])
            for i, e in enumerate(experts):
                self.weights[(layer, int(e))] = tuple(t[i] for t in stacks)
        self.fp8_block = fp8_block if any(len(t) == 4 for t in self.stacks) else None
        self.token_counts = np.zeros((placement.num_layers, self.slots.size), dtype=np.int64)  # per local replica
        self.num_in_flight = 0  # calls being computed (the servicer counts, in the event loop)
        self.last_call_at = 0.0

    def activation_dtype(self, layer: int, wire_dtype: torch.dtype) -> torch.dtype:
        """The dtype a call's activations are computed in: the weights' dtype, or for block-FP8
        weights the activations' own (W8A16 / W8A8 kernels take bf16 / fp32 inputs)."""
        return wire_dtype if self.fp8_block is not None else self.w13[layer].dtype

    def experts(self) -> set[LayerExpert]:
        return set(self.weights)

    def run(
        self,
        layer: int,
        x: torch.Tensor,  # [num_tokens, hidden]
        row_ids: torch.Tensor,  # [num_entries] int64 rows of x
        local: torch.Tensor,  # [num_entries] int64 local replica of each entry
    ) -> torch.Tensor:  # [num_entries, hidden] unweighted expert outputs
        rows = x.index_select(0, row_ids)  # [num_entries, hidden]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return run_experts(rows, self.stacks[layer], self.fp8_block, ones, local[:, None])

    def run_combined(
        self,
        layer: int,
        x: torch.Tensor,  # [num_tokens, hidden]
        row_ids: torch.Tensor,  # [num_entries] int64 rows of x, grouped by replica
        local: torch.Tensor | None,  # [num_entries] int64 local replica of each entry (read by the FP8 path only)
        weights: torch.Tensor,  # [num_entries] float32 gate weights
        groups: tuple[list[int], list[int]],  # (local replica, entries) of each group, in entry order
    ) -> torch.Tensor:  # [num_tokens, hidden] float32: per token, sum of w * E(x) over its entries here
        """The worker-side combine: the weighted outputs are added per token in float32, entries in
        request order (grouped by replica, tokens ascending within a replica: the local kernel's
        order restricted to this worker's experts). Each group's rows go through its replica's
        matmuls straight from x (kernels.grouped_moe): no per-entry copy of the rows."""
        if self.fp8_block is None:
            w13, w2 = self.stacks[layer]
            return grouped_moe(x, w13, w2, row_ids, *groups, weights)
        rows = x.index_select(0, row_ids)  # [num_entries, hidden]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        y = run_experts(rows, self.stacks[layer], self.fp8_block, ones, local[:, None])  # [num_entries, hidden]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, row_ids, y.float() * weights[:, None])
        return out


class ReplicaStore:
    def __init__(
        self,
        worker_id: str,
        shape: MoEShape,
        read_weights: Callable[[set[LayerExpert]], dict[LayerExpert, ExpertTensors]],
    ):
        self.worker_id, self.shape = worker_id, shape
        self._read_weights = read_weights
        self._versions: dict[int, HostedVersion] = {}

    def check(self, placement: Placement) -> None:
        """Raises PlacementError when the placement does not fit this model."""
        if (placement.num_layers, placement.num_experts) != (self.shape.num_layers, self.shape.num_experts):
            raise PlacementError(
                f"placement {placement.version} covers {placement.num_layers} MoE layers x {placement.num_experts} "
                f"experts; the model has {self.shape.num_layers} x {self.shape.num_experts}"
            )

    def load(self, placement: Placement) -> HostedVersion:
        self.check(placement)
        hosted_now = list(self._versions.values())
        in_memory: dict[LayerExpert, ExpertTensors] = {}
        for hosted in hosted_now:
            in_memory.update(hosted.weights)
        owned = self.worker_id in placement.worker_ids
        slots = placement.slots_of(self.worker_id) if owned else np.zeros(0, dtype=np.int64)
        needed = {(layer, int(e)) for layer in range(placement.num_layers) for e in placement.phy2log[layer, slots]}
        weights = {key: in_memory[key] for key in needed if key in in_memory}
        missing = needed - set(weights)
        if missing:
            weights.update(self._read_weights(missing))
        hosted = HostedVersion(placement, self.worker_id, weights, self.shape.fp8_block)
        self._versions = {**self._versions, placement.version: hosted}
        return hosted

    def get(self, version: int) -> HostedVersion | None:
        return self._versions.get(version)

    def versions(self) -> list[int]:
        return sorted(self._versions)

    def release(self, version: int) -> None:
        self._versions = {v: h for v, h in self._versions.items() if v != version}

    def hosted_experts(self) -> set[LayerExpert]:
        experts: set[LayerExpert] = set()
        for hosted in self._versions.values():
            experts |= hosted.experts()
        return experts
