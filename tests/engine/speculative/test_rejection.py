"""Lossless verification: the emitted tokens follow the target distribution exactly."""

from __future__ import annotations

import torch

from moemesh.engine.runner.rejection_sampler import verify_drafts

VOCAB = 6
P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])  # target
Q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.25, 0.25])  # a poor draft, so rejections are common


def draft_batch(num_rows: int, k: int, point_mass: bool, seed: int):
    """num_rows independent trials: drafts sampled from Q (or a fixed point-mass draft)."""
    g = torch.Generator().manual_seed(seed)
    if point_mass:
        drafts = torch.full((num_rows, k), 0, dtype=torch.int64)  # always drafts token 0 (p = 0.35)
        draft_probs = None
    else:
        drafts = torch.multinomial(Q.expand(num_rows * k, VOCAB), 1, generator=g).view(num_rows, k)
        draft_probs = Q.expand(num_rows, k, VOCAB).contiguous()
    target = P.expand(num_rows, k + 1, VOCAB).contiguous()
    return target, drafts, draft_probs, g


def total_variation(tokens: list[int]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float()
    return 0.5 * (counts / counts.sum() - P).abs().sum().item()


def emitted_tv(verify, point_mass: bool, position: int = 0, num_rows: int = 40000, k: int = 3) -> float:
    target, drafts, draft_probs, g = draft_batch(num_rows, k, point_mass, seed=position + 7)
    out = verify(target, drafts, torch.full((num_rows,), k), torch.zeros(num_rows, dtype=torch.bool), draft_probs, g)
    return total_variation([t[position] for t in out.token_ids if len(t) > position])


def wrong_verify(target, drafts, num_drafts, greedy, draft_probs, g):
    """Resamples from the target itself on rejection instead of the residual: biased."""
    residual_free = verify_drafts(target, drafts, num_drafts, greedy, draft_probs, g)
    fixed = []
    for tokens, n in zip(residual_free.token_ids, residual_free.num_accepted):
        if n < drafts.shape[1]:
            tokens = tokens[:-1] + [int(torch.multinomial(P, 1, generator=g))]
        fixed.append(tokens)
    residual_free.token_ids = fixed
    return residual_free


def test_first_and_later_tokens_follow_the_target_with_a_sampled_draft():
    # 40k trials: sampling noise of the TV distance is ~0.005; a biased verifier is ~0.05 off.
    assert emitted_tv(verify_drafts, point_mass=False, position=0) < 0.015
    assert emitted_tv(verify_drafts, point_mass=False, position=1) < 0.015


def test_tokens_follow_the_target_with_point_mass_drafts():
    assert emitted_tv(verify_drafts, point_mass=True, position=0) < 0.015
    assert emitted_tv(verify_drafts, point_mass=True, position=2) < 0.015


def test_a_deliberately_wrong_verifier_fails_the_same_check():
    assert emitted_tv(wrong_verify, point_mass=False, position=0) > 0.03
    assert emitted_tv(wrong_verify, point_mass=True, position=0) > 0.03


def test_greedy_rows_accept_the_matching_prefix_then_emit_the_argmax():
    logits = torch.tensor([[0, 5, 1], [3, 0, 1], [0, 1, 9], [7, 0, 0]], dtype=torch.float32)
    target = torch.softmax(logits, -1)[None].repeat(3, 1, 1)  # argmax per position: 1, 0, 2, 0
    drafts = torch.tensor([[1, 0, 2], [1, 2, 2], [0, 0, 0]])
    out = verify_drafts(target, drafts, torch.tensor([3, 3, 2]), torch.ones(3, dtype=torch.bool))
    assert out.token_ids == [[1, 0, 2, 0], [1, 0], [1]]
    assert out.num_accepted == [3, 1, 0]


def test_requests_without_drafts_emit_one_token():
    target = torch.softmax(torch.tensor([[[0.0, 9.0, 0.0]]]), -1)
    out = verify_drafts(
        target, torch.zeros(1, 0, dtype=torch.int64), torch.tensor([0]), torch.ones(1, dtype=torch.bool)
    )
    assert out.token_ids == [[1]] and out.num_accepted == [0]
