"""The engine options as command-line flags and mesh config sections, generated from the one
definition (`moemesh.runtime.engine_config`).

Flags: `--` + the option's name in dashes (`--kv-memory-gib`), booleans as a pair
(`--enable-prefix-caching/--no-enable-prefix-caching`), choices by their spelling
(`--micro-batch-overlap auto|on|off`), help from the field's doc. The parsed namespace remembers
which engine flags the command line gave (`given`), so `moemesh serve` resolves each option as
flag > mesh config > default, while every flag still holds its default for readers that take it
as is (the router's `--block-size`).

Mesh config (`--config`, the operator's ConfigMap `mesh.json`): `engine` holds values for the whole
mesh, `roles.<role>.engine` a role's own (only options whose `per_role` allows it), both by flat
name and spelled as the flags spell them.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from moemesh.runtime.engine_config import BY_NAME, ENGINE, OPTIONS, ROLES, ConfigError, EngineConfig, Option, build
from moemesh.runtime.settings import SettingsError

_GIVEN = "engine_options_given"  # the namespace attribute: names of the engine flags given


def _given_set(namespace: argparse.Namespace) -> set[str]:
    if getattr(namespace, _GIVEN, None) is None:
        setattr(namespace, _GIVEN, set())
    return getattr(namespace, _GIVEN)


class _Store(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _given_set(namespace).add(self.dest)


class _StoreBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _given_set(namespace).add(self.dest)


def given(args: argparse.Namespace) -> set[str]:
    """The engine options the command line set (by flat name)."""
    return set(getattr(args, _GIVEN, None) or ())


def options_for(exclude: Iterable[str] = ()) -> tuple[Option, ...]:
    """The options a command takes as flags: all of them, but those it `exclude`s."""
    skip = set(exclude)
    assert skip <= set(BY_NAME), skip - set(BY_NAME)
    return tuple(o for o in OPTIONS if o.name not in skip)


def help_text(o: Option, default: Any, surface: str = "serve") -> str:
    """The field's doc, the `moemesh serve` roles that read it (unless just the engine's), the default."""
    every = surface != "serve" or o.roles == ENGINE
    roles = "" if every else f" [roles: {', '.join(r for r in ROLES if r in o.roles)}]"
    spelled = o.spell(default)
    shown = "" if spelled in (None, "") else f" (default: {str(spelled).lower() if o.kind is bool else spelled})"
    return (o.doc + roles + shown).replace("%", "%%")


def _metavar(o: Option) -> str | None:
    if o.choices is not None:
        return None
    return {int: "N", float: "NUM"}.get(o.kind) or o.name.rsplit("_", 1)[-1].upper()


def add_engine_arguments(parser, surface: str = "serve", exclude: Iterable[str] = ()) -> None:
    """One flag per engine option (`surface`: "serve" for moemesh serve / up, "offline" for
    moemesh generate, whose defaults are LLM(...)'s)."""
    for o in options_for(exclude):
        default = o.default_for(surface)
        if o.kind is bool and o.choices is None:
            parser.add_argument(
                o.flag, dest=o.name, action=_StoreBool, default=default, help=help_text(o, default, surface)
            )
            continue
        kwargs: dict[str, Any] = {"type": o.kind} if o.choices is None else {"choices": list(o.choices)}
        parser.add_argument(
            o.flag,
            dest=o.name,
            action=_Store,
            default=o.spell(default),
            metavar=_metavar(o),
            help=help_text(o, default, surface),
            **kwargs,
        )


def from_flags(args: argparse.Namespace, exclude: Iterable[str] = ()) -> EngineConfig:
    """The EngineConfig of the flags alone (moemesh generate); the `exclude`d options keep the
    definition's defaults. Raises SettingsError naming the flag of a bad value."""
    try:
        return build({o.name: o.parse(getattr(args, o.name)) for o in options_for(exclude)})
    except ConfigError as e:
        raise SettingsError(e.named(lambda name: BY_NAME[name].flag)) from e


def argv(values: Mapping[str, Any]) -> list[str]:
    """The flags that set `values` (flat name -> value as the field holds it)."""
    out: list[str] = []
    for name, value in values.items():
        o = BY_NAME[name]
        if o.kind is bool and o.choices is None:
            out.append(o.flag if value else "--no-" + o.flag[2:])
        elif value is not None:
            out += [o.flag, str(o.spell(value))]
    return out


def _mesh_sections(config: Mapping[str, Any], role: str) -> list[tuple[str, dict]]:
    """The mesh config's engine sections that `role` reads, most specific first, each with the
    prefix that names its keys in messages; raises SettingsError for a malformed section or key."""
    roles = config.get("roles") or {}
    if not isinstance(roles, dict) or not isinstance(roles.get(role) or {}, dict):
        raise SettingsError(f"mesh config roles must map a role to an object, got {roles!r}")
    sections = []
    for prefix, section in (
        (f"roles.{role}.engine", (roles.get(role) or {}).get("engine")),
        ("engine", config.get("engine")),
    ):
        if section is None:
            continue
        if not isinstance(section, dict):
            raise SettingsError(f"mesh config {prefix} must be an object, got {section!r}")
        for key in section:
            o = BY_NAME.get(key)
            if o is None or not o.in_mesh:
                raise SettingsError(
                    f"mesh config {prefix}.{key}: not an engine option (known: {', '.join(_mesh_names())})"
                )
            if prefix != "engine" and not o.per_role:
                raise SettingsError(f"mesh config {prefix}.{key}: one value for the whole mesh; set it in engine")
        sections.append((f"mesh config {prefix}", section))
    return sections


def _mesh_names() -> list[str]:
    return [o.name for o in OPTIONS if o.in_mesh]


def _source(o: Option, flags: set[str], sections: list[tuple[str, dict]]) -> tuple[str, dict | None]:
    """Where a value comes from: (its flag, None) when given or written nowhere else, else (its mesh
    config key, that section)."""
    if o.name not in flags:
        for prefix, section in sections:
            if o.name in section:
                return f"{prefix}.{o.name}", section
    return o.flag, None


def source(args: argparse.Namespace, config: Mapping[str, Any], role: str, name: str) -> str:
    """How a message names the place `role`'s value of option `name` came from: its flag, or its
    mesh config key."""
    return _source(BY_NAME[name], given(args), _mesh_sections(config, role))[0]


def resolve(
    args: argparse.Namespace,
    config: Mapping[str, Any],
    role: str,
    fixed: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """`role`'s EngineConfig: for each option that applies to the role, the flag if the command
    line gave it, else the mesh config's role section, else its engine section, else the flag's
    default; `fixed` (flat name -> value) wins over all. Options of other roles keep the
    definition's defaults. Raises SettingsError naming where the bad value was written."""
    sections, flags = _mesh_sections(config, role), given(args)
    values: dict[str, Any] = {}
    names: dict[str, str] = {}

    def spell(name: str) -> str:
        return names.get(name, BY_NAME[name].flag)

    try:
        for o in OPTIONS:
            if o.applies_to(role):
                names[o.name], section = _source(o, flags, sections)
                values[o.name] = o.parse(getattr(args, o.name) if section is None else section[o.name])
        values.update(fixed or {})
        return build(values)
    except ConfigError as e:
        raise SettingsError(e.named(spell)) from e
