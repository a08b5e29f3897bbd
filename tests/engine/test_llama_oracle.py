"""Greedy outputs and logits of the SmolLM2 GGUF against Hugging Face transformers loading the
same file, under batching, prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import torch

from moemesh import LLM

from .oracle_helpers import CHAT, GREEDY, max_rel_error, prefill_then_decode_logits


def test_all_prompts_in_one_mixed_batch_match_hf(smollm, prompt_ids, hf_greedy):
    outputs = smollm.generate(prompt_ids, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy
    assert len({len(p) for p in prompt_ids}) > 4  # genuinely mixed lengths


def test_second_pass_hits_the_prefix_cache_and_outputs_are_unchanged(smollm, prompt_ids, hf_greedy):
    smollm.generate(prompt_ids, GREEDY)
    hits_before = smollm.engine.kv_cache_manager.stats.num_hits
    outputs = smollm.generate(prompt_ids, GREEDY)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert smollm.engine.kv_cache_manager.stats.num_hits > hits_before
    assert [o.token_ids for o in outputs] == hf_greedy


def test_chunked_prefill_with_a_small_token_budget_matches_hf(smollm_path, prompt_ids, hf_greedy):
    llm = LLM(smollm_path, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False, show_progress=False)
    assert sum(len(p) > 16 for p in prompt_ids) >= 2  # prompts really are split into chunks
    outputs = llm.generate(prompt_ids, GREEDY)
    assert [o.token_ids for o in outputs] == hf_greedy


def test_kv_pool_so_small_that_preemption_happens_matches_hf(smollm_path, prompt_ids, hf_greedy):
    llm = LLM(smollm_path, block_size=16, num_blocks=10, show_progress=False)
    outputs = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == hf_greedy
    assert llm.engine.kv_cache_manager.num_used_blocks == 0


def test_chat_helper_applies_the_models_template(smollm, prompt_ids, hf_greedy):
    output = smollm.chat(CHAT, GREEDY)[0]
    assert output.prompt_token_ids == prompt_ids[-1]
    assert output.token_ids == hf_greedy[-1]


def test_logits_match_hf_within_1e_4_relative(smollm_path, hf_model, prompt_ids):
    llm = LLM(smollm_path, enable_prefix_caching=False, show_progress=False)
    ids = prompt_ids[4]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]  # [num_tokens, vocab]
    rel = max_rel_error(prefill_then_decode_logits(llm, ids), ref)
    assert rel < 1e-4, rel
