"""Per-request sampling parameters, validated at construction (the request boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.engine.errors import InvalidRequestError

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match (enforced by engine/structured_output.py). `spec` is the JSON
    schema text (kind json), the regex, or the EBNF grammar; kind choice uses `choices`, kind
    json_object needs nothing."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "choices", tuple(self.choices))
        _check(self.kind in STRUCTURED_KINDS, "structured_output", f"kind must be one of {STRUCTURED_KINDS}")
        if self.kind == "choice":
            _check(bool(self.choices) and all(self.choices), "guided_choice", "must be non-empty strings")
        elif self.kind != "json_object":
            _check(bool(self.spec), self.param, "must not be empty")

    @property
    def param(self) -> str:
        """The request field an error names."""
        return "response_format" if self.kind.startswith("json") else f"guided_{self.kind}"


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
    # vLLM/OpenAI logits processing (engine/logits_processors.py)
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # prompt + output tokens: positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    structured_output: StructuredOutputSpec | None = None  # a grammar the output must match

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")  # fmt: skip
        _check(all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
               "keys must be token ids >= 0 and values in [-100, 100]")  # fmt: skip
        _check(len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias", "has a token id twice")
        _check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}"
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logits_processors(self) -> bool:
        """Penalties, logit_bias or min_tokens (engine/logits_processors.py)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (penalties,
        logit_bias, min_tokens, a grammar). Such requests are not speculated (see
        engine/logits_processors.py and engine/structured_output.py)."""
        return self.has_logits_processors or self.structured_output is not None


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


GREEDY = SamplingParams(temperature=0.0)
