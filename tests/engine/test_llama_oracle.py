"""Greedy outputs and logits of the SmolLM2 GGUF against Hugging Face transformers loading the
same file, under batching, prefix caching, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from moemesh import LLM, SamplingParams

from .oracle_helpers import max_rel_error, prefill_then_decode_logits

MAX_NEW = 24
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4,",
    "Über café naïve — 日本語のテスト",
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far from the "
    "coast. Every night he climbed the stairs, lit the lamp, and watched the ships pass. One winter",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\nx = np.arange(10)\n",
    "The three primary colors are",
]
CHAT = [{"role": "user", "content": "Name two planets of the solar system."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer):
    ids = [hf_tokenizer(p).input_ids for p in PROMPTS]
    chat = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    return ids + [list(chat)]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    """One prompt at a time (no padding): the plain oracle."""
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


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
