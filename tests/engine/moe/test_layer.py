"""The MoE layer's gating and combine against a plain-python reference: which experts each token
gets, with which weights, and the layer output y = sum_e w_e E_e(x) (+ shared experts).

The gate weight is [I | 0], so router logits are exactly the first num_experts coordinates of x
and ties can be written into the input."""

from __future__ import annotations

import math

import pytest
import torch

from moemesh.engine.layers.expert_executor import LocalExpertExecutor
from moemesh.engine.layers.expert_load_counter import ExpertLoadCounter
from moemesh.engine.layers.moe import GatingConfig, MoERuntime, SparseMoE
from moemesh.engine.models.llama import LlamaMLP

HIDDEN, INTER = 16, 8


class RecordingExecutor(LocalExpertExecutor):
    """A local executor that remembers what the layer handed it."""

    def forward(self, layer, hidden_states, topk_ids, topk_weights):
        self.seen = (topk_ids.clone(), topk_weights.clone())
        return super().forward(layer, hidden_states, topk_ids, topk_weights)


def make_layer(gating: GatingConfig, bias: list[float] | None = None, shared: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    runtime = MoERuntime(executor=None, expert_load=ExpertLoadCounter(1, gating.num_experts, num_buckets=4))
    shared_experts = LlamaMLP(HIDDEN, INTER) if shared else None
    layer = SparseMoE(0, HIDDEN, INTER, gating, runtime, shared_experts, has_correction_bias=bias is not None)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[:, : gating.num_experts] = torch.eye(gating.num_experts)
        if bias is not None:
            layer.gate.e_score_correction_bias.copy_(torch.tensor(bias))
        for p in [layer.experts.w13, layer.experts.w2, *(shared_experts.parameters() if shared else [])]:
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    runtime.executor = RecordingExecutor([layer.experts])
    return layer


def inputs_with_ties(num_tokens: int, num_experts: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[0, :num_experts] = 0.5  # every expert tied
    x[1, 1] = x[1, 6] = x[1, :num_experts].max() + 1  # two tied leaders
    x[2, 3] = x[2, 2]
    return x


# -- plain-python references -------------------------------------------------------------------
def py_topk_softmax(logits: list[float], top_k: int, renormalize: bool):
    m = max(logits)
    exps = [math.exp(v - m) for v in logits]
    probs = [e / sum(exps) for e in exps]
    chosen = sorted(range(len(logits)), key=lambda e: (-probs[e], e))[:top_k]  # ties: lower index
    weights = [probs[e] for e in chosen]
    if renormalize:
        weights = [w / sum(weights) for w in weights]
    return chosen, weights


def py_grouped_topk(logits: list[float], bias: list[float], gating: GatingConfig):
    scores = [1 / (1 + math.exp(-v)) for v in logits]
    biased = [s + b for s, b in zip(scores, bias)]
    size = len(logits) // gating.num_expert_group
    groups = [list(range(g * size, (g + 1) * size)) for g in range(gating.num_expert_group)]
    group_score = [sum(sorted((biased[e] for e in grp), reverse=True)[:2]) for grp in groups]
    kept = sorted(range(len(groups)), key=lambda g: (-group_score[g], g))[: gating.topk_group]
    candidates = [e for g in kept for e in groups[g]]  # experts of dropped groups never compete
    chosen = sorted(candidates, key=lambda e: (-biased[e], e))[: gating.top_k]
    weights = [scores[e] for e in chosen]  # unbiased scores
    if gating.renormalize:
        weights = [w / sum(weights) for w in weights]
    return chosen, [w * gating.routed_scaling_factor for w in weights]


def py_layer_output(layer: SparseMoE, x: torch.Tensor, routing) -> torch.Tensor:
    """float64, one token and one expert at a time."""
    w13, w2 = layer.experts.w13.double(), layer.experts.w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, (chosen, weights) in enumerate(routing):
        xt = x[t].double()
        for e, w in zip(chosen, weights):
            gate, up = (w13[e] @ xt).chunk(2)
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    if layer.shared_experts is not None:
        out += layer.shared_experts.double()(x.double())
        layer.shared_experts.float()
    return out


def _assert_routing(layer: SparseMoE, routing) -> None:
    ids, weights = layer.runtime.executor.seen
    assert ids.tolist() == [chosen for chosen, _ in routing]
    expected = torch.tensor([w for _, w in routing], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_gating_gives_each_token_the_reference_experts_and_weights_ties_to_the_lower_index(renormalize):
    gating = GatingConfig(num_experts=8, top_k=2, renormalize=renormalize)
    layer = make_layer(gating)
    x = inputs_with_ties(24, 8)
    with torch.no_grad():
        y = layer(x)
    routing = [py_topk_softmax(x[t, :8].tolist(), 2, renormalize) for t in range(len(x))]
    assert routing[0][0] == [0, 1] and routing[1][0] == [1, 6]  # the crafted ties
    _assert_routing(layer, routing)
    torch.testing.assert_close(y.double(), py_layer_output(layer, x, routing), rtol=1e-5, atol=1e-6)


def test_grouped_gating_uses_the_bias_for_selection_only_masks_dropped_groups_and_scales_the_weights():
    gating = GatingConfig(
        num_experts=8,
        top_k=3,
        renormalize=True,
        method="grouped_topk",
        num_expert_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    # Groups {0,1} {2,3} {4,5} {6,7}. Biased scores of experts 1, 3, 5, 7 are negative, so each
    # kept group has one positive expert and top_k=3 must take a negative one from a kept group
    # (masking dropped groups with 0.0 would take a dropped-group expert instead).
    bias = [0.1, -2.0, 0.0, -2.0, 0.2, -2.0, -0.1, -2.0]
    layer = make_layer(gating, bias=bias, shared=True)
    x = inputs_with_ties(32, 8, seed=2)
    with torch.no_grad():
        y = layer(x)
    routing = [py_grouped_topk(x[t, :8].tolist(), bias, gating) for t in range(len(x))]
    assert routing[0][0] == [4, 0, 1]  # all scores tied: groups by biased sums, then the lower index
    for chosen, _ in routing:
        assert sum(1 for e in chosen if bias[e] < -1) == 1  # one negative expert per token
    _assert_routing(layer, routing)
    weight_sums = layer.runtime.executor.seen[1].sum(dim=-1)  # normalized, then x routed_scaling_factor
    torch.testing.assert_close(weight_sums, torch.full_like(weight_sums, 2.5))
    torch.testing.assert_close(y.double(), py_layer_output(layer, x, routing), rtol=1e-5, atol=1e-6)


def test_the_layer_counts_the_logical_experts_it_routes_to():
    gating = GatingConfig(num_experts=8, top_k=2, renormalize=True)
    layer = make_layer(gating)
    x = torch.zeros(5, HIDDEN)
    pairs = [(3, 1), (3, 0), (7, 3), (2, 5), (3, 1)]  # (best, second) expert of each token
    for t, (a, b) in enumerate(pairs):
        x[t, a], x[t, b] = 10.0, 5.0
    layer.runtime.expert_load.begin_step()
    with torch.no_grad():
        layer(x)
    assert layer.runtime.executor.seen[0].tolist() == [list(p) for p in pairs]
    assert layer.runtime.expert_load.counts().tolist() == [[1, 2, 1, 4, 0, 1, 0, 1]]
