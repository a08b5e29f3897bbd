"""Per-request sampling parameters and their bounds, defined once for the router and the engine.

`BOUNDS` is the one table of what each bounded field accepts. `SamplingParams` checks every
field against it at construction (raising InvalidRequestError naming the field), and the
router's request models take their pydantic bounds from it (router/openai_protocol.py), so the
router and the engine accept and refuse exactly the same values. Where OpenAI and vLLM differ,
the bound is OpenAI's where it has the field (temperature in [0, 2], penalties in [-2, 2],
logit_bias in [-100, 100], top logprobs up to 20) and vLLM's for its extensions; integers that
travel in the proto's int32/int64 fields are bounded by those.

The proto form of these parameters is converted in contracts/sampling_proto.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moemesh.text.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Bound:
    """A closed interval [low, high], or (low, high] with `low_open`; `integer` values only."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False

    def contains(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not isinstance(value, int):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        return f"{kind} in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"


BOUNDS: dict[str, Bound] = {
    "temperature": Bound(0.0, 2.0),  # OpenAI's range; 0: greedy
    "top_p": Bound(0.0, 1.0, low_open=True),
    "top_k": Bound(-1, INT32_MAX, integer=True),  # 0 or -1: all tokens
    "min_p": Bound(0.0, 1.0),
    "seed": Bound(INT64_MIN, INT64_MAX, integer=True),
    "max_tokens": Bound(1, INT32_MAX, integer=True),  # and the prompt plus these within the context
    "min_tokens": Bound(0, INT32_MAX, integer=True),  # and at most max_tokens
    "logprobs": Bound(0, 20, integer=True),  # top logprobs per token (chat: top_logprobs)
    "presence_penalty": Bound(-2.0, 2.0),
    "frequency_penalty": Bound(-2.0, 2.0),
    "repetition_penalty": Bound(0.0, 2.0, low_open=True),  # 1: off
    "logit_bias": Bound(-100.0, 100.0),  # each bias
    "token_id": Bound(0, INT32_MAX, integer=True),  # stop_token_ids, logit_bias keys
}

_SCALAR_FIELDS = tuple(name for name in BOUNDS if name not in ("logit_bias", "token_id"))  # one value each
_OPTIONAL_FIELDS = ("seed", "logprobs")  # None: unset

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match (enforced by engine/runner/structured_output.py). `spec` is
    the JSON schema text (kind json), the regex, or the EBNF grammar; kind choice uses
    `choices`, kind json_object needs nothing."""

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
    # vLLM/OpenAI logits processing (engine/runner/logits_processors.py)
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # prompt + output tokens: positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    structured_output: StructuredOutputSpec | None = None  # a grammar the output must match

    def __post_init__(self):
        for name in _SCALAR_FIELDS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL_FIELDS:
                _check_bound(name, value)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _check(all(isinstance(s, str) and s for s in stop), "stop", "strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids)
        _check(
            all(BOUNDS["token_id"].contains(t) for t in stop_ids),
            "stop_token_ids",
            f"must hold token ids, each {BOUNDS['token_id'].describe()}",
        )
        object.__setattr__(self, "stop_token_ids", stop_ids)
        bias = tuple(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        _check(
            all(BOUNDS["token_id"].contains(t) and BOUNDS["logit_bias"].contains(b) for t, b in bias),
            "logit_bias",
            f"maps token ids ({BOUNDS['token_id'].describe()}) to biases ({BOUNDS['logit_bias'].describe()})",
        )
        _check(len({t for t, _ in bias}) == len(bias), "logit_bias", "has a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in bias)))
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) exceeds max_tokens ({self.max_tokens})",
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def has_logits_processors(self) -> bool:
        """Penalties, logit_bias or min_tokens (engine/runner/logits_processors.py)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before temperature (penalties,
        logit_bias, min_tokens, a grammar). Such requests are not speculated (see
        engine/runner/logits_processors.py and engine/runner/structured_output.py)."""
        return self.has_logits_processors or self.structured_output is not None


def _check_bound(name: str, value) -> None:
    bound = BOUNDS[name]
    _check(bound.contains(value), name, f"must be {bound.describe()}, got {value!r}")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {message}", param=param)


def _num(value: float) -> str:
    return str(int(value)) if math.isfinite(value) and value == int(value) else str(value)


GREEDY = SamplingParams(temperature=0.0)
