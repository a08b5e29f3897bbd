"""Lossless verification of draft tokens, for all requests of a round at once.

Input per request r: the target model's (processed) next-token distributions p[r, j] at every
draft position j = 0..k_r (k_r drafts give k_r + 1 positions), the drafts d[r, 0..k_r), and the
draft distributions q[r, j] (None: point masses on the drafts, as n-gram lookup proposes).

- greedy rows accept the longest prefix with d_j == argmax p_j, then emit argmax p at the first
  mismatch (or the bonus position k_r);
- sampled rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
  they emit a sample of normalise(max(0, p_j - q_j)); if every draft is accepted, a sample of
  p_{k_r}. The emitted sequence is then distributed exactly as sampling from p token by token.

Every request emits between 1 and k_r + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then the correction / bonus token
    num_accepted: list[int]  # accepted drafts per request (len(token_ids[r]) - 1)


def verify_drafts(
    target_probs: torch.Tensor,  # [num_reqs, max_k + 1, vocab] float32, rows past k_r unused
    draft_token_ids: torch.Tensor,  # [num_reqs, max_k] int64, padded with 0
    num_drafts: torch.Tensor,  # [num_reqs] int64, k_r
    greedy: torch.Tensor,  # [num_reqs] bool
    draft_probs: torch.Tensor | None = None,  # [num_reqs, max_k, vocab] float32; None: point masses
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    num_reqs, max_k = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(num_reqs, device=device)
    positions = torch.arange(max_k, device=device)
    in_range = positions[None, :] < num_drafts[:, None]  # [num_reqs, max_k]

    drafts = draft_token_ids.clamp(min=0)
    p_of_draft = target_probs[:, :max_k].gather(2, drafts[..., None])[..., 0]  # [num_reqs, max_k]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, drafts[..., None])[..., 0]
    uniform = torch.rand(p_of_draft.shape, generator=generator, device=device)
    sampled_accept = uniform * q_of_draft < p_of_draft  # u < p / q without dividing by zero
    greedy_accept = drafts == target_probs[:, :max_k].argmax(dim=-1)
    accept = torch.where(greedy[:, None], greedy_accept, sampled_accept) & in_range
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # [num_reqs], first rejection stops it

    # The token after the accepted prefix: argmax (greedy), or a sample of the residual
    # max(0, p - q) at a rejected position, or of p itself at the bonus position.
    p_next = target_probs[rows, num_accepted]  # [num_reqs, vocab]
    rejected = num_accepted < num_drafts
    if max_k == 0:
        q_next = torch.zeros_like(p_next)  # nothing drafted: the bonus position only
    elif draft_probs is None:
        q_next = torch.zeros_like(p_next)
        q_next[rows, drafts[rows, num_accepted.clamp(max=max_k - 1)]] = 1.0
    else:
        q_next = draft_probs[rows, num_accepted.clamp(max=max_k - 1)]
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp(min=1e-30)
    sampled = torch.multinomial(residual, 1, generator=generator)[:, 0]
    next_token = torch.where(greedy, p_next.argmax(dim=-1), sampled)

    drafts_list, accepted_list, next_list = drafts.tolist(), num_accepted.tolist(), next_token.tolist()
    token_ids = [drafts_list[r][: accepted_list[r]] + [next_list[r]] for r in range(num_reqs)]
    return VerifyOutput(token_ids, accepted_list)
