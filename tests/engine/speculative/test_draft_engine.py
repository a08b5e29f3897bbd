"""Draft-model speculation in the engine: greedy output on the real SmolLM2 is token-identical to
no speculation (with a perfect draft and with a random one), and sampled output keeps the target
model's distribution."""

from __future__ import annotations

import pytest
import torch

from moemesh import LLM, SamplingParams
from moemesh.engine.config import SpecConfig
from moemesh.engine.runner import model_runner
from moemesh.engine.runner.rejection_sampler import verify_drafts

from .conftest import save_tiny_llama
from .test_spec_engine import GREEDY, PROMPTS


@pytest.fixture(scope="module")
def reference(smollm):
    return [o.token_ids for o in smollm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "draft, scheduling",
    # a random draft's confidences are ~1e-3, so the DSpark rule would verify none of its drafts
    [("smollm", "confidence"), ("random", "fixed")],
    ids=["own-draft-confidence", "random-draft-fixed"],
)
def test_draft_model_speculation_keeps_greedy_output_identical(smollm_path, tiny_draft, reference, draft, scheduling):
    draft_path = smollm_path if draft == "smollm" else tiny_draft[0]
    spec = SpecConfig(method="draft", draft_model=draft_path, scheduling=scheduling, num_speculative_tokens=4)
    llm = LLM(smollm_path, speculative=spec, show_progress=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    if draft == "random":  # prefix-cache hits, the draft's cache rolled back after rejections every round
        second = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in second] == reference
        assert sum(o.num_cached_tokens for o in second) > 0
    stats, spec_stats = llm.engine.stats(), llm.engine.spec.stats
    assert spec_stats.num_draft_tokens > 0
    if draft == "smollm":  # the target drafting for itself: nearly every draft is accepted
        assert stats["spec_acceptance_rate"] > 0.9
        assert stats["spec_mean_accepted_length"] > 3
    else:  # a random draft: rejections nearly every round
        assert stats["spec_acceptance_rate"] < 0.1
    assert llm.engine.kv_cache_manager.num_used_blocks == 0


@pytest.fixture
def one_thread():
    """Thousands of tiny forwards: thread hand-offs would dominate them on a shared CPU."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def resample_from_target_on_rejection(
    target_probs, draft_token_ids, num_drafts, greedy, draft_probs=None, generator=None
):
    """A deliberately wrong verifier: after a rejection it samples p instead of max(0, p - q)."""
    out = verify_drafts(target_probs, draft_token_ids, num_drafts, greedy, draft_probs, generator)
    for r, n in enumerate(out.num_accepted):
        if n < int(num_drafts[r]) and not bool(greedy[r]):
            out.token_ids[r][-1] = int(torch.multinomial(target_probs[r, n], 1, generator=generator))
    return out


@pytest.mark.parametrize("lossless", [True, False], ids=["verify_drafts", "wrong-verifier"])
def test_sampling_with_a_draft_model_keeps_the_target_distribution(tmp_path, one_thread, monkeypatch, lossless):
    """A tiny target with 16 tokens, its first layer as the draft; the 2nd and 3rd sampled tokens
    (both verified against drafts) follow the target's exact marginals, computed with
    transformers, and a deliberately wrong verifier fails the same check."""
    vocab, num_samples, prompt = 16, 3000, [3, 1, 4, 1, 5, 9]
    target = save_tiny_llama(str(tmp_path / "target"), vocab_size=vocab, seed=1)
    spec = SpecConfig(
        method="draft",
        draft_model=str(tmp_path / "target"),
        draft_num_layers=1,  # self-speculative
        scheduling="fixed",
        num_speculative_tokens=2,
        draft_kv_memory_gib=0.01,
    )
    if not lossless:
        monkeypatch.setattr(model_runner, "verify_drafts", resample_from_target_on_rejection)
    llm = LLM(
        str(tmp_path / "target"), num_blocks=1024, max_num_seqs=256, seed=3, speculative=spec, show_progress=False
    )
    outs = llm.generate([prompt] * num_samples, SamplingParams(temperature=1.0, max_tokens=4))
    stats = llm.engine.spec.stats
    assert 0.1 < stats.acceptance_rate < 0.9  # drafts both accepted and rejected

    with torch.no_grad():  # exact P(t1), P(t1, t2), P(t1, t2, t3)
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        seq2 = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = p1[:, None] * torch.softmax(target(seq2).logits[:, -1].double(), -1)  # [V, V]
        seq3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = p2.reshape(-1, 1) * torch.softmax(target(seq3).logits[:, -1].double(), -1)  # [V * V, V]
    tvs = []
    for position, exact in ((1, p2.sum(0)), (2, p3.sum(0))):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=vocab)
        tvs.append(0.5 * (counts.double() / num_samples - exact).abs().sum().item())
    # 3000 samples of 16 tokens: sampling noise ~0.02; the wrong verifier is ~0.09 off at token 2
    if lossless:
        assert max(tvs) < 0.05, f"total variation from the target at tokens 2, 3: {tvs}"
    else:
        assert max(tvs) > 0.05, f"the wrong verifier passed: {tvs}"
