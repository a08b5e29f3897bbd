"""ExpertExecutor and placement: replicas of a hot expert change nothing in the output, and the
hot expert's tokens are split over its replicas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.layers.expert_executor import ExpertPlacement, LocalExpertExecutor
from moemesh.engine.layers.moe import RoutedExperts

from .models import build_qwen3_moe, make_prompts, save_tiny

NUM_EXPERTS, HIDDEN, INTER, HOT = 8, 16, 8, 3


def make_experts(num_layers: int = 2, seed: int = 0) -> list[RoutedExperts]:
    gen = torch.Generator().manual_seed(seed)
    experts = [RoutedExperts(NUM_EXPERTS, HIDDEN, INTER) for _ in range(num_layers)]
    with torch.no_grad():
        for e in experts:
            e.w13.copy_(torch.randn(e.w13.shape, generator=gen))
            e.w2.copy_(torch.randn(e.w2.shape, generator=gen))
    return experts


def hot_routing(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token's first choice is the hot expert; the second is random among the others."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)  # [num_tokens, hidden]
    others = torch.tensor([e for e in range(NUM_EXPERTS) if e != HOT])
    second = others[torch.randint(0, len(others), (num_tokens,), generator=gen)]
    topk_ids = torch.stack((torch.full((num_tokens,), HOT), second), dim=1)  # [num_tokens, 2]
    topk_weights = torch.rand(num_tokens, 2, generator=gen)  # [num_tokens, 2]
    return x, topk_ids, topk_weights


# Layer 0: experts 0..7 then a second replica of the hot expert (slot 8); layer 1: a permuted
# layout with the hot expert's replicas at slots 0 and 5.
PHY2LOG = [[0, 1, 2, 3, 4, 5, 6, 7, HOT], [HOT, 7, 6, 5, 4, 3, 2, 1, 0]]


def test_two_replicas_of_a_hot_expert_give_the_identity_output_and_share_its_tokens():
    experts = make_experts()
    identity = LocalExpertExecutor(experts)
    replicated = LocalExpertExecutor(experts, ExpertPlacement(torch.tensor(PHY2LOG), NUM_EXPERTS))
    x, topk_ids, topk_weights = hot_routing(33)
    for layer, hot_slots in ((0, [HOT, 8]), (1, [0, 5])):
        expected = identity.forward(layer, x, topk_ids, topk_weights)
        torch.testing.assert_close(replicated.forward(layer, x, topk_ids, topk_weights), expected, rtol=1e-6, atol=1e-6)
        slots = replicated.placement.replica_ids(layer, topk_ids)  # [num_tokens, 2]
        hot_counts = [int((slots[:, 0] == s).sum()) for s in hot_slots]
        assert sorted(hot_counts) == [16, 17]  # 33 hot tokens, split evenly
        phy2log = torch.tensor(PHY2LOG[layer])
        assert torch.equal(phy2log[slots], topk_ids)  # every slot holds the routed expert


def test_replica_weights_are_copies_of_their_experts():
    experts = make_experts()
    executor = LocalExpertExecutor(experts, ExpertPlacement(torch.tensor(PHY2LOG), NUM_EXPERTS))
    w13, w2 = executor._weights(1)
    assert w13.shape[0] == 9
    assert torch.equal(w13[0], experts[1].w13[HOT]) and torch.equal(w13[5], experts[1].w13[HOT])
    assert torch.equal(w2[1], experts[1].w2[7])


def test_identity_placement_maps_ids_to_themselves_without_copying_weights():
    experts = make_experts()
    executor = LocalExpertExecutor(experts)
    _, topk_ids, _ = hot_routing(4)
    assert executor.placement.is_identity
    assert executor.placement.replica_ids(0, topk_ids) is topk_ids
    assert executor._weights(0)[0] is experts[0].w13


def test_a_placement_must_give_every_expert_a_replica_and_fit_the_model():
    with pytest.raises(ValueError, match="expert 7 has no replica in MoE layer 0"):
        ExpertPlacement(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6]]), NUM_EXPERTS)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement(torch.tensor([[0, 8]]), NUM_EXPERTS)
    executor = LocalExpertExecutor(make_experts(num_layers=2))
    with pytest.raises(ValueError, match="covers 1 MoE layers"):
        executor.set_placement(ExpertPlacement.identity(1, NUM_EXPERTS))


def test_the_operators_placement_record_maps_onto_the_same_tables():
    from moemesh.contracts.placement import make_placement

    record = make_placement(4, PHY2LOG, ["w0", "w1", "w2"], NUM_EXPERTS)  # 9 slots, 3 per worker
    local = ExpertPlacement.from_placement(record)
    assert local.version == 4 and local.num_replicas == record.num_slots
    assert np.array_equal(local.replica_counts.numpy(), record.replica_counts)
    assert np.array_equal(local.log2phy.numpy(), record.log2phy)


def test_the_engine_gives_the_same_tokens_under_a_replicated_placement(tmp_path):
    save_tiny(build_qwen3_moe, str(tmp_path))
    llm = LLM(str(tmp_path), block_size=4, num_blocks=128, enable_prefix_caching=False, show_progress=False)
    prompts, params = make_prompts()[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    model = llm.engine.model
    num_moe, num_experts = len(model.moe_layers()), 16
    hot = model.expert_load.counts().argmax(dim=1)  # [num_moe] the hottest expert of each layer
    phy2log = torch.cat((torch.arange(num_experts).repeat(num_moe, 1), hot[:, None]), dim=1)  # [num_moe, 17]
    model.moe_runtime.executor.set_placement(ExpertPlacement(phy2log, num_experts, version=1))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
