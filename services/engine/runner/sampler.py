"""Vectorized sampling for all requests of a round in one call.

First the logits processing that can change the greedy token (min_tokens, logit_bias,
penalties: `logits_processors.py`). Greedy rows then take argmax. Other rows: temperature, then top-k, top-p and min-p masks, then the
exponential-race trick (argmax of p / q with q ~ Exp(1)), which samples from p. Seeded requests
draw q from their own generator, so their output does not depend on what else is batched.
Logprobs are of the model's raw distribution (before temperature and truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.engine.runner.logits_processors import LogitsAdjustments


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [num_reqs] float32, 0 = greedy
    top_k: torch.Tensor  # [num_reqs] int64, 0 = off
    top_p: torch.Tensor  # [num_reqs] float32
    min_p: torch.Tensor  # [num_reqs] float32
    generators: dict[int, torch.Generator]  # row -> generator, for seeded rows
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_num_logprobs: int  # -1: none requested
    adjustments: LogitsAdjustments | None = None  # None: no row adjusts its logits

    def repeat_rows(self, n: int) -> SamplingTensors:
        """Each row n times in a row (one per verified position of a speculating request)."""
        assert self.adjustments is None, "requests that adjust their logits are not speculated"
        rep = lambda x: x.repeat_interleave(n)  # noqa: E731
        return SamplingTensors(
            rep(self.temperature),
            rep(self.top_k),
            rep(self.top_p),
            rep(self.min_p),
            {},
            self.all_greedy,
            self.need_top_k,
            self.need_top_p,
            self.need_min_p,
            self.max_num_logprobs,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: torch.Tensor | None  # [num_reqs, 1 + n] sampled token first, then top-n
    logprob_token_ids: torch.Tensor | None  # [num_reqs, 1 + n]


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # for unseeded rows

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        raw = logits.float()  # [num_reqs, vocab]
        logits = t.adjustments.apply(raw.clone()) if t.adjustments is not None else raw
        greedy_ids = logits.argmax(dim=-1)
        if t.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = self._sample(logits, t)
            token_ids = torch.where(t.temperature == 0, greedy_ids, token_ids)
        if t.max_num_logprobs < 0:
            return SamplerOutput(token_ids, None, None)
        logprobs = torch.log_softmax(raw, dim=-1)
        sampled = logprobs.gather(1, token_ids[:, None])
        top_vals, top_ids = logprobs.topk(t.max_num_logprobs, dim=-1)
        return SamplerOutput(
            token_ids,
            torch.cat((sampled, top_vals), dim=1),
            torch.cat((token_ids[:, None], top_ids), dim=1),
        )

    def probs(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k, top-p, min-p applied
        (greedy rows: the plain softmax, whose argmax is the greedy token). `logits` are
        already adjusted (`t.adjustments`)."""
        temperature = torch.where(t.temperature == 0, torch.ones_like(t.temperature), t.temperature)
        logits = logits.float() / temperature[:, None]
        if t.need_top_k or t.need_top_p:
            logits = _apply_top_k_top_p(logits, t.top_k if t.need_top_k else None, t.top_p if t.need_top_p else None)
        probs = torch.softmax(logits, dim=-1)
        if t.need_min_p:
            threshold = probs.max(dim=-1, keepdim=True).values * t.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        probs = self.probs(logits, t)
        q = torch.empty_like(probs)
        if len(t.generators) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        for row, generator in t.generators.items():
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k and top-p nucleus (one sort)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending: kept tail at the end
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        kth = sorted_logits.gather(1, (vocab - k)[:, None])  # smallest kept value per row
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        drop = cumulative <= (1 - top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
