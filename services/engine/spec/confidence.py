"""Confidence-scheduled verification length (DSpark).

Each request i has draft confidences c_i1..c_ik; the survival of its prefix of length j is
a_ij = c_i1 * ... * c_ij, the probability that drafts 1..j are all accepted. Verifying prefixes
j <= k_i of every request costs sum_i (1 + k_i) tokens in the round (plus the round's other
tokens) and yields, in expectation, sum_i (1 + sum_{j<=k_i} a_ij) tokens. We maximise

    expected tokens per second = E[tokens] * steps_per_second(batch tokens)

greedily: candidates (i, j) are admitted in decreasing a_ij (a prefix is always admitted before
its extensions, since a_ij decreases in j), and admission stops at the first candidate that does
not raise the objective. steps_per_second comes from a cost table the engine measures at start-up.
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
) -> dict[str, int]:
    """How many drafts of each request to verify this round (0 for requests with none).

    num_other_tokens: tokens of the round that are not decode tokens (prefill chunks)."""
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
    best = expected / cost.step_seconds(num_tokens)
    for survival, j, request_id in candidates:
        if lengths[request_id] != j - 1:
            continue  # its prefix was not admitted
        value = (expected + survival) / cost.step_seconds(num_tokens + 1)
        if value <= best:
            break
        lengths[request_id], expected, num_tokens, best = j, expected + survival, num_tokens + 1, value
    return lengths
