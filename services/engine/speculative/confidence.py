"""Confidence-scheduled verification length (DSpark).

Each request i has draft confidences c_i1..c_ik; the survival of its prefix of length j is
a_ij = c_i1 * ... * c_ij, the probability that drafts 1..j are all accepted. Verifying prefixes
j <= k_i of every request costs sum_i (1 + k_i) tokens in the round (plus the round's other
tokens) and yields, in expectation, sum_i (1 + sum_{j<=k_i} a_ij) tokens. We maximise

    expected tokens per second = E[tokens] / (draft_seconds + step_seconds(batch tokens))

greedily: candidates (i, j) are taken in decreasing a_ij (a prefix always comes before its
extensions, since a_ij decreases in j). DSpark stops at the first candidate that does not raise
the objective; we evaluate every prefix of that order and keep the best one, which is the same
set when the objective is unimodal, and does not stall where the measured cost is not: on a CPU
a 2-token round costs far more than a 1-token one (GEMM instead of GEMV) and then stays flat, so
the first draft alone never pays but four do. steps_per_second comes from a cost table the
engine measures at start-up; draft_seconds is what drafting took this round (a draft model's k
forwards; about zero for n-gram lookup): spent whatever is verified, it makes longer
verifications relatively cheaper.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class CostTable:
    """Seconds per model step as a function of the round's token count (linear interpolation,
    flat beyond the ends)."""

    num_tokens: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]

    def __post_init__(self):
        assert len(self.num_tokens) == len(self.seconds) >= 1
        assert all(a < b for a, b in zip(self.num_tokens, self.num_tokens[1:])), "num_tokens must increase"

    def step_seconds(self, num_tokens: int) -> float:
        xs, ys = self.num_tokens, self.seconds
        if num_tokens <= xs[0]:
            return ys[0]
        if num_tokens >= xs[-1]:
            return ys[-1] * num_tokens / xs[-1]  # beyond the table: proportional to tokens
        i = bisect.bisect_right(xs, num_tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)


def schedule_draft_lengths(
    confidences: dict[str, list[float]],
    cost: CostTable,
    num_other_tokens: int = 0,
    draft_seconds: float = 0.0,
) -> dict[str, int]:
    """How many drafts of each request to verify this round (0 for requests with none).

    num_other_tokens: tokens of the round that are not decode tokens (prefill chunks);
    draft_seconds: the round's drafting time, added to every candidate set's cost."""
    lengths = {request_id: 0 for request_id in confidences}
    candidates = []
    for request_id, conf in confidences.items():
        survival = 1.0
        for j, c in enumerate(conf, start=1):
            survival *= c
            candidates.append((survival, j, request_id))
    candidates.sort(key=lambda t: (-t[0], t[1], t[2]))
    num_tokens = num_other_tokens + len(confidences)
    expected = float(len(confidences))
    best, best_len = expected / (draft_seconds + cost.step_seconds(num_tokens)), 0
    admitted: list[tuple[str, int]] = []
    for survival, j, request_id in candidates:
        admitted.append((request_id, j))
        expected, num_tokens = expected + survival, num_tokens + 1
        value = expected / (draft_seconds + cost.step_seconds(num_tokens))
        if value > best:
            best, best_len = value, len(admitted)
    for request_id, j in admitted[:best_len]:
        lengths[request_id] = j
    return lengths
