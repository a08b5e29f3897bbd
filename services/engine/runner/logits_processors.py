"""Logits processing that can change the greedy token, batched over a round's rows, in vLLM's
order and with its formulas (vLLM v1 `Sampler.forward`, `apply_penalties`):

    1. min_tokens: EOS and stop_token_ids -> -inf while fewer than min_tokens tokens are out
    2. logit_bias: added to the listed tokens
    3. repetition penalty r over prompt + output tokens: positive logits / r, negative ones * r
    4. frequency penalty f: minus f * (occurrences of the token in the output)
    5. presence penalty p: minus p * (1 if the token is in the output)

The sampler then applies temperature, min-p, top-k/top-p. Logprobs stay the raw model's.
Every step is a tensor op over the rows that need it: sparse (row, token) index_put for the
bias and the min_tokens mask, scatter_add bin counts for the penalties (prompts and outputs
padded to the longest with the out-of-vocabulary id `vocab_size`).

Speculative decoding: a request with any of these is never speculated (`SpecDecoder.prepare`
skips it, `SamplingParams.adjusts_logits`). Penalties and min_tokens depend on every token
before a position, drafts included, so verification would need per-position histories; we
keep verification simple and exact instead, at the cost of plain decoding for such requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moemesh.engine.sampling_params import SamplingParams


class RowHistory(Protocol):
    """What the processors read of a request (the runner's `CachedRequestState`)."""

    sampling_params: SamplingParams
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    eos_token_id: int | None


@dataclass
class LogitsAdjustments:
    bias_rows: torch.Tensor  # [num_biases] int64
    bias_token_ids: torch.Tensor  # [num_biases] int64
    bias_values: torch.Tensor  # [num_biases] float32
    banned_rows: torch.Tensor  # [num_banned] int64 (min_tokens)
    banned_token_ids: torch.Tensor  # [num_banned] int64
    penalty_rows: torch.Tensor  # [num_penalised] int64
    prompt_token_ids: torch.Tensor  # [num_penalised, max_prompt] int64, padded with vocab_size
    output_token_ids: torch.Tensor  # [num_penalised, max_output] int64, padded with vocab_size
    presence: torch.Tensor  # [num_penalised] float32
    frequency: torch.Tensor  # [num_penalised] float32
    repetition: torch.Tensor  # [num_penalised] float32

    @classmethod
    def build(cls, rows: list[RowHistory], vocab_size: int, device) -> LogitsAdjustments | None:
        """None when no row adjusts its logits (the common case costs nothing)."""
        if not any(r.sampling_params.has_logits_processors for r in rows):
            return None
        bias, banned, penalised = [], [], []
        for i, r in enumerate(rows):
            p = r.sampling_params
            bias.extend((i, t, b) for t, b in p.logit_bias)
            if len(r.token_ids) - r.num_prompt_tokens < p.min_tokens:
                stops = set(p.stop_token_ids)
                if not p.ignore_eos and r.eos_token_id is not None:
                    stops.add(r.eos_token_id)
                banned.extend((i, t) for t in sorted(stops) if t < vocab_size)
            if p.has_penalties:
                penalised.append(i)
        ints = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        floats = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
        prompts = [rows[i].token_ids[: rows[i].num_prompt_tokens] for i in penalised]
        outputs = [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in penalised]
        params = [rows[i].sampling_params for i in penalised]
        return cls(
            bias_rows=ints([b[0] for b in bias]),
            bias_token_ids=ints([b[1] for b in bias]),
            bias_values=floats([b[2] for b in bias]),
            banned_rows=ints([b[0] for b in banned]),
            banned_token_ids=ints([b[1] for b in banned]),
            penalty_rows=ints(penalised),
            prompt_token_ids=_padded(prompts, vocab_size, device),
            output_token_ids=_padded(outputs, vocab_size, device),
            presence=floats([p.presence_penalty for p in params]),
            frequency=floats([p.frequency_penalty for p in params]),
            repetition=floats([p.repetition_penalty for p in params]),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, vocab] float32, changed in place and returned."""
        if len(self.banned_rows):
            logits.index_put_((self.banned_rows, self.banned_token_ids), torch.tensor(float("-inf")))
        if len(self.bias_rows):
            logits.index_put_((self.bias_rows, self.bias_token_ids), self.bias_values, accumulate=True)
        if len(self.penalty_rows):
            logits[self.penalty_rows] = apply_penalties(
                logits[self.penalty_rows],
                self.prompt_token_ids,
                self.output_token_ids,
                self.presence,
                self.frequency,
                self.repetition,
            )
        return logits


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab]
    prompt_token_ids: torch.Tensor,  # [num_rows, max_prompt] padded with vocab
    output_token_ids: torch.Tensor,  # [num_rows, max_output] padded with vocab
    presence: torch.Tensor,  # [num_rows]
    frequency: torch.Tensor,  # [num_rows]
    repetition: torch.Tensor,  # [num_rows]
) -> torch.Tensor:
    vocab = logits.shape[1]
    in_prompt = _bin_counts(prompt_token_ids, vocab) > 0  # [num_rows, vocab]
    output_counts = _bin_counts(output_token_ids, vocab).to(logits.dtype)  # [num_rows, vocab]
    in_output = output_counts > 0
    r = torch.where(in_prompt | in_output, repetition[:, None], torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / r, logits * r)
    return logits - frequency[:, None] * output_counts - presence[:, None] * in_output


def _bin_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[num_rows, vocab] occurrences of each token per row (the padding id `vocab` dropped)."""
    counts = torch.zeros(token_ids.shape[0], vocab + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab]


def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device).view(
        len(rows), width
    )
