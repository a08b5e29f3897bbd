"""Speculative decoding on the real SmolLM2: greedy output is token-identical to no speculation."""

from __future__ import annotations

import pytest

from moemesh import LLM, SamplingParams
from moemesh.engine.config import SpecConfig

PROMPTS = [
    "Repeat the text exactly.\nText: The quick brown fox jumps over the lazy dog. The quick brown fox "
    "jumps over the lazy dog.\nRepeated text:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Tell me about the moon.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "A list of colors: red, green, blue, red, green, blue, red,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(smollm):
    return [o.token_ids for o in smollm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("scheduling", ["fixed", "confidence"])
def test_ngram_speculation_keeps_greedy_output_identical(smollm_path, reference, scheduling):
    spec = SpecConfig(method="ngram", scheduling=scheduling, num_speculative_tokens=4)
    llm = LLM(smollm_path, speculative=spec, show_progress=False)
    first = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference
    if scheduling == "fixed":  # prefix-cache hits with drafts in flight
        second = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in second] == reference
        assert sum(o.num_cached_tokens for o in second) > 0
    stats = llm.engine.stats()
    assert stats["spec_mean_accepted_length"] > 1.5  # the repetitive prompts really speculate
    assert 0 < stats["spec_acceptance_rate"] <= 1
    assert llm.engine.kv_cache_manager.num_used_blocks == 0


def test_stop_strings_and_max_tokens_cut_speculated_output_exactly(smollm, smollm_path):
    params = SamplingParams(temperature=0.0, max_tokens=23, stop=(" lazy dog.",))
    expected = smollm.generate(PROMPTS[:2], params)
    llm = LLM(smollm_path, speculative=SpecConfig(method="ngram", scheduling="fixed"), show_progress=False)
    got = llm.generate(PROMPTS[:2], params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in expected
    ]


def test_sampled_requests_with_speculation_finish_and_free_their_blocks(smollm_path):
    llm = LLM(smollm_path, speculative=SpecConfig(method="ngram"), show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24))
    assert all(o.finished and 1 <= len(o.token_ids) <= 24 for o in outs)
    assert llm.engine.kv_cache_manager.num_used_blocks == 0
