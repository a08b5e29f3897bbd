"""Qwen3-MoE, Mixtral and DeepSeek-V3 (MLA + DeepSeekMoE) through the full engine against
Hugging Face transformers on the same tiny random checkpoints: greedy tokens identical over
8 prompts x 24 tokens (mixed batch, prefix-cached second pass, chunked prefill) and float32
logits within 1e-4 relative."""

from __future__ import annotations

import pytest
import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.layers.mla_attention import MLAAttention
from moemesh.engine.layers.moe import select_experts

from ..oracle_helpers import max_rel_error, prefill_then_decode_logits
from .models import BUILDERS, MAX_NEW, build_deepseek_v3, hf_greedy, make_prompts, save_tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory):
    """(checkpoint dir, HF model, prompts, HF greedy outputs) for one architecture."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = save_tiny(BUILDERS[request.param], path)
    prompts = make_prompts()
    return path, hf, prompts, [hf_greedy(hf, p) for p in prompts]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(checkpoint dir, HF config) of the DeepSeek-V3 model above, for the MLA and gating checks."""
    path = str(tmp_path_factory.mktemp("deepseek_v3_only"))
    return path, save_tiny(BUILDERS["deepseek_v3"], path).config


def _engine(path: str, **kw) -> LLM:
    kw = {"block_size": 4, "num_blocks": 128, "show_progress": False} | kw
    return LLM(path, **kw)


def test_mixed_batch_then_prefix_cached_second_pass_match_hf_greedy(tiny):
    path, _, prompts, expected = tiny
    llm = _engine(path)
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == expected
    assert sum(o.num_cached_tokens for o in first) > 0  # prompts 5 and 6 reuse prompt 4's blocks
    second = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in second] == expected
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)


def test_chunked_prefill_with_a_small_token_budget_matches_hf_greedy(tiny):
    path, _, prompts, expected = tiny
    llm = _engine(path, max_num_seqs=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert max(len(p) for p in prompts) > 8  # prompts really are split into chunks
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_logits_match_hf_within_1e_4_relative(tiny):
    path, hf, prompts, expected = tiny
    ids = prompts[6] + expected[6]  # 45 tokens: prefill 44, decode 1
    ours = prefill_then_decode_logits(_engine(path, enable_prefix_caching=False), ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [num_tokens, vocab]
    assert max_rel_error(ours, ref) < 1e-4


def test_deepseek_v3_without_q_lora_matches_hf_logits(tmp_path):
    hf = save_tiny(lambda: build_deepseek_v3(q_lora_rank=None), str(tmp_path), seed=3)
    llm = _engine(str(tmp_path), enable_prefix_caching=False)
    assert hasattr(llm.engine.model.model.layers[0].self_attn, "q_proj")
    ids = make_prompts(seed=5)[6]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert max_rel_error(prefill_then_decode_logits(llm, ids), ref) < 1e-4


def test_deepseek_v3_paged_cache_holds_only_the_latent_and_rope_key(deepseek):
    path, cfg = deepseek
    llm = _engine(path)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim  # 40, vs 2 * 4 heads * 24 = 192 for full K/V
    for attn in llm.engine.model.attention_layers():
        assert isinstance(attn, MLAAttention)
        assert tuple(attn.kv_cache.shape) == (128, 4, 1, width)
    assert llm.engine.budget.bytes_per_block == cfg.num_hidden_layers * 4 * width * 4


def test_deepseek_v3_fixture_biases_change_selection_and_hit_the_negative_masking_case(deepseek):
    """Guards the oracle above: the correction biases matter, and in MoE layer 1 masking dropped
    groups with 0.0 instead of -inf would select different experts."""
    path, cfg = deepseek
    moe = _engine(path).engine.model.moe_layers()
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in moe:
        logits = layer.gate(x)
        _, ids = select_experts(logits, layer.gating, layer.gate.e_score_correction_bias)
        _, unbiased_ids = select_experts(logits, layer.gating, torch.zeros_like(layer.gate.e_score_correction_bias))
        assert (ids.sort(-1).values != unbiased_ids.sort(-1).values).any(-1).float().mean() > 0.2
    layer = moe[1]
    ids = select_experts(layer.gate(x), layer.gating, layer.gate.e_score_correction_bias)[1]
    zero_masked = _zero_masked_grouped_ids(layer.gate(x), layer.gate.e_score_correction_bias, layer.gating)
    assert (ids.sort(-1).values != zero_masked.sort(-1).values).any(-1).float().mean() > 0.5


def _zero_masked_grouped_ids(logits, bias, gating) -> torch.Tensor:
    scores = logits.float().sigmoid() + bias
    grouped = scores.view(len(scores), gating.num_expert_group, -1)
    kept = grouped.topk(2, dim=-1).values.sum(-1).topk(gating.topk_group, dim=-1).indices
    mask = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~mask[..., None], 0.0).flatten(1).topk(gating.top_k, dim=-1).indices
