"""Per-request sampling parameters, validated at construction (the request boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 (or -1) means all tokens."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the first match
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the sampled token's plus the top n

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0 or -1: disabled), got {self.top_k}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens > 0,
            "max_tokens",
            f"must be a positive integer, got {self.max_tokens}",
        )
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}"
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


GREEDY = SamplingParams(temperature=0.0)
