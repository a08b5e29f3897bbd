"""`micro_batch_overlap=None` (auto) with remote experts: ping-pong where it is measured to pay.

Ping-pong hides one micro-batch's remote experts behind the other's attention, but each
micro-batch reads every routed expert's weights again and pays the transport's fixed cost per
layer again. Where decode MoE is bound by weight bandwidth (few rows per expert) or the attention
side has no idle core to overlap onto (a small CPU box), two micro-batches are slower than one
batch. SGLang's two-batch overlap has a token threshold for this; here the runner measures it.

Per round shape (all-decode or not, and the round's tokens bucketed to a power of two) the tuner
has the runner time the model forward both ways, alternating, ``num_trials`` rounds each (the
first is overlapped: auto starts on), then keeps the faster mode by median. After
``reprobe_every`` rounds of a shape it measures again, as the load on the machine changes.
Greedy outputs are the same either way (tests/engine/test_overlap.py); only the speed differs.

Callers: `ModelRunner.execute` asks ``use_overlap(shape)`` before a round it could split, and
reports the forward's seconds (on ``clock``) with ``record(shape, overlapped, seconds)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

RoundShape = tuple[bool, int]  # (every request decodes, ceil(log2(num_tokens)))


def round_shape(num_tokens: int, all_decode: bool) -> RoundShape:
    return all_decode, max(num_tokens - 1, 0).bit_length()


@dataclass
class _ShapeStats:
    seconds: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})
    num_rounds: int = 0  # rounds since the last measurement started


class OverlapTuner:
    def __init__(self, num_trials: int = 3, reprobe_every: int = 1000, clock: Callable[[], float] = time.perf_counter):
        if num_trials < 1 or reprobe_every <= 2 * num_trials:
            raise ValueError("need num_trials >= 1 and reprobe_every > 2 * num_trials")
        self.num_trials, self.reprobe_every = num_trials, reprobe_every
        self.clock = clock  # what the runner times forwards with
        self._stats: dict[RoundShape, _ShapeStats] = {}

    def measuring(self, shape: RoundShape) -> bool:
        """True while this shape's rounds are being timed (the caller then times the forward)."""
        stats = self._stats.get(shape)
        return stats is None or min(len(v) for v in stats.seconds.values()) < self.num_trials

    def use_overlap(self, shape: RoundShape) -> bool:
        stats = self._stats.setdefault(shape, _ShapeStats())
        stats.num_rounds += 1
        if stats.num_rounds > self.reprobe_every:
            self._stats[shape] = stats = _ShapeStats(num_rounds=1)
        on, off = stats.seconds[True], stats.seconds[False]
        if min(len(on), len(off)) < self.num_trials:
            return len(on) <= len(off)  # alternate, overlapped first
        return _median(on) <= _median(off)

    def record(self, shape: RoundShape, overlapped: bool, seconds: float) -> None:
        samples = self._stats.setdefault(shape, _ShapeStats()).seconds[overlapped]
        if len(samples) < self.num_trials:
            samples.append(seconds)

    def chosen(self) -> dict[RoundShape, bool]:
        """The mode of each fully measured shape (benchmarks, logs)."""
        return {
            shape: _median(s.seconds[True]) <= _median(s.seconds[False])
            for shape, s in self._stats.items()
            if not self.measuring(shape)
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
