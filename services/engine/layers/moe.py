"""The Mixture-of-Experts FFN layer every MoE architecture uses.

    y = sum over the routed experts e of w_e * E_e(x)  (+ shared(x)),   E_e = SwiGLU expert FFN

One forward: router logits (`MoEGate`) -> top-k selection (`select_experts`, through the kernels'
gating functions) -> load counting (logical ids) -> `ExpertExecutor` (dispatch to the experts'
replicas, expert FFNs, weighted combine) -> + shared experts.

For ping-pong micro-batch overlap the same forward is split in two: `start` (gating, load
counting, `ExpertExecutor.submit`) and `finish` (shared experts, then `ExpertExecutor.wait` and
the sum), so the decoder stack can run the other micro-batch's attention while the routed experts
run remotely. `forward(x)` is `finish(start(x))` with the synchronous `ExpertExecutor.forward`.

Gating recipes (`GatingConfig.method`):
- "topk_softmax" (Mixtral, Qwen3-MoE): softmax over all experts, the top_k largest, optionally
  renormalized (`norm_topk_prob`; Mixtral always).
- "grouped_topk" (DeepSeek-V3): sigmoid scores; `e_score_correction_bias` added for selection
  only; group score = sum of each group's top-2 biased scores; the best `topk_group` of
  `num_expert_group` groups are kept and the others masked with -inf; top_k experts on the masked
  biased scores; weights = the unbiased scores, renormalized when `norm_topk_prob`, times
  `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moemesh import kernels
from moemesh.engine.layers.expert_executor import ExpertExecutor, ExpertHandle
from moemesh.engine.layers.expert_load_counter import ExpertLoadCounter
from moemesh.kernels.fp8 import FP8_DTYPE, cdiv

_METHODS = ("topk_softmax", "grouped_topk")


@dataclass(frozen=True)
class GatingConfig:
    num_experts: int
    top_k: int
    renormalize: bool
    method: str = "topk_softmax"
    scoring_func: str = "sigmoid"  # grouped_topk only: "sigmoid" or "softmax"
    num_expert_group: int = 1  # grouped_topk only
    topk_group: int = 1  # grouped_topk only
    routed_scaling_factor: float = 1.0  # grouped_topk only

    def __post_init__(self):
        if self.method not in _METHODS:
            raise ValueError(f"gating method must be one of {_METHODS}, got {self.method!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    gating: GatingConfig,
    e_score_correction_bias: torch.Tensor | None = None,  # [num_experts]
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    if gating.method == "topk_softmax":
        return kernels.topk_softmax(router_logits, gating.top_k, gating.renormalize)
    return kernels.grouped_topk(
        router_logits,
        gating.top_k,
        gating.num_expert_group,
        gating.topk_group,
        e_score_correction_bias,
        gating.renormalize,
        gating.routed_scaling_factor,
        gating.scoring_func,
    )


class MoEGate(nn.Module):
    """Router: logits = x @ weight^T, plus DeepSeek-V3's selection-only correction bias.
    Checkpoint names: `gate.weight` [num_experts, hidden], `gate.e_score_correction_bias`."""

    def __init__(self, hidden_size: int, num_experts: int, has_correction_bias: bool, float32_logits: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if has_correction_bias else None
        )
        self.float32_logits = float32_logits  # DeepSeek-V3 routes in float32 whatever the model dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, num_experts]
        if self.float32_logits:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class RoutedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w13 [num_experts, 2 * intermediate, hidden]
    (gate rows, then up rows) and w2 [num_experts, hidden, intermediate], the layout of
    `kernels.fused_moe` and of transformers' in-memory `experts.gate_up_proj` / `down_proj`.

    Block-FP8 storage (`use_fp8`, DeepSeek-V3 checkpoints): w13 / w2 float8_e4m3fn plus float32
    buffers w13_scale_inv [num_experts, 2 * ceil(I / bn), ceil(H / bk)] (each expert's gate_proj
    scales, then its up_proj scales, each part blocked on its own) and w2_scale_inv
    [num_experts, ceil(H / bn), ceil(I / bk)], the layout of `kernels.dispatch.fp8_fused_moe`.
    The scales are buffers, not parameters: the loader writes them (loader/fp8_checkpoint.py)."""

    fp8_block: tuple[int, int] | None = None  # (block_n, block_k) when the weights are block-FP8

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def drop_weights(self) -> None:
        """Hold no expert (zero rows): a worker whose routed experts run on expert workers."""
        self.w13 = nn.Parameter(self.w13.new_empty(0, *self.w13.shape[1:]), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0, *self.w2.shape[1:]), requires_grad=False)
        if self.fp8_block is not None:
            self.w13_scale_inv = self.w13_scale_inv.new_empty(0, *self.w13_scale_inv.shape[1:])
            self.w2_scale_inv = self.w2_scale_inv.new_empty(0, *self.w2_scale_inv.shape[1:])

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Switch to block-FP8 storage (uninitialized, on the weights' device: meta before loading)."""
        block_n, block_k = block
        num_experts, rows, hidden = self.w13.shape
        inter = rows // 2
        self.w13 = nn.Parameter(self.w13.new_empty(self.w13.shape, dtype=FP8_DTYPE), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(self.w2.shape, dtype=FP8_DTYPE), requires_grad=False)
        scales = dict(dtype=torch.float32, device=self.w13.device)
        self.register_buffer(
            "w13_scale_inv", torch.empty(num_experts, 2 * cdiv(inter, block_n), cdiv(hidden, block_k), **scales)
        )
        self.register_buffer(
            "w2_scale_inv", torch.empty(num_experts, cdiv(hidden, block_n), cdiv(inter, block_k), **scales)
        )
        self.fp8_block = (int(block_n), int(block_k))


@dataclass
class MoERuntime:
    """What a model's MoE layers share: where experts run and where load is counted. Swap the
    executor (e.g. for a remote one) between steps; the layers read it at every forward."""

    executor: ExpertExecutor
    expert_load: ExpertLoadCounter


@dataclass
class PendingMoE:
    """A started MoE layer (`SparseMoE.start`), finished by `SparseMoE.finish`."""

    x: torch.Tensor  # [num_tokens, hidden], the layer input (the shared experts read it)
    handle: ExpertHandle  # the routed experts in flight


class SparseMoE(nn.Module):
    def __init__(
        self,
        layer: int,  # MoE-layer ordinal, the index into placement and load counters
        hidden_size: int,
        intermediate_size: int,  # per routed expert
        gating: GatingConfig,
        runtime: MoERuntime,
        shared_experts: nn.Module | None = None,  # x [num_tokens, hidden] -> [num_tokens, hidden]
        has_correction_bias: bool = False,
        float32_logits: bool = False,
    ):
        super().__init__()
        self.layer, self.gating = layer, gating
        self.gate = MoEGate(hidden_size, gating.num_experts, has_correction_bias, float32_logits)
        self.experts = RoutedExperts(gating.num_experts, hidden_size, intermediate_size)
        self.shared_experts = shared_experts
        self.runtime = runtime  # shared by the model's MoE layers; not module state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, hidden] -> [num_tokens, hidden]
        topk_weights, topk_ids = self._route(x)
        out = self.runtime.executor.forward(self.layer, x, topk_ids, topk_weights)  # [num_tokens, hidden]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def start(self, x: torch.Tensor) -> PendingMoE:  # x [num_tokens, hidden]
        """Gate and submit the routed experts; returns before they have run (remote executor)."""
        topk_weights, topk_ids = self._route(x)
        return PendingMoE(x, self.runtime.executor.submit(self.layer, x, topk_ids, topk_weights))

    def finish(self, pending: PendingMoE) -> torch.Tensor:  # [num_tokens, hidden], as forward returns
        """The shared experts (while the routed ones may still run), then the routed output."""
        shared = self.shared_experts(pending.x) if self.shared_experts is not None else None
        out = self.runtime.executor.wait(pending.handle)  # [num_tokens, hidden]
        return out if shared is None else out + shared

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # weights, ids [num_tokens, top_k]
        router_logits = self.gate(x)  # [num_tokens, num_experts]
        topk_weights, topk_ids = select_experts(router_logits, self.gating, self.gate.e_score_correction_bias)
        self.runtime.expert_load.record(self.layer, topk_ids)
        return topk_weights, topk_ids
