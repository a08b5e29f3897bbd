"""The engine settings of an InferenceMesh, spelled from the one config definition
(`moemesh.runtime.engine_config`): `spec.engine` holds values for every pod that reads them,
`spec.<role>.engine` a role's own (options whose `per_role` allows it, read by that role), keys in
camelCase (`kv_memory_gib` -> `kvMemoryGib`), values as `moemesh serve`'s flags spell them.

Parsed once: an unknown key, a wrong type, a value out of its bounds, a mesh-wide option set for
one role, and a combination the engine refuses (per role, as each role's pods will resolve it) are
`EngineSpecError`s naming the field. The parsed values go into mesh.json as its `engine` and
`roles.<role>.engine` sections (`mesh_config`), which every pod reads, the router included.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moemesh.runtime.engine_config import BY_NAME, OPTIONS, ConfigError, Option, build

CR_ROLES = ("router", "prefill", "decode", "expert")
CR_OPTIONS = tuple(o for o in OPTIONS if o.in_mesh)
BY_CAMEL = {o.camel: o for o in CR_OPTIONS}


class EngineSpecError(ValueError):
    """spec.engine or spec.<role>.engine cannot be served as written (the message names the field)."""


@dataclass(frozen=True)
class EngineSpec:
    """Validated engine settings, by flat name and spelled as written (JSON values)."""

    mesh: Mapping[str, Any] = field(default_factory=dict)  # spec.engine
    roles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # spec.<role>.engine, roles that have one

    def mesh_config(self) -> dict[str, Any]:
        """mesh.json's sections: `engine`, and `roles.<role>.engine` for the roles with their own."""
        sections: dict[str, Any] = {}
        if self.mesh:
            sections["engine"] = dict(self.mesh)
        if self.roles:
            sections["roles"] = {role: {"engine": dict(values)} for role, values in self.roles.items()}
        return sections


def parse_engine(spec: Mapping[str, Any], legacy_dtype: str | None = None) -> EngineSpec:
    """`spec.engine` and each `spec.<role>.engine`; `legacy_dtype` (spec.model.dtype) is the dtype
    when spec.engine sets none. Raises EngineSpecError."""
    mesh = _section(spec.get("engine"), "spec.engine", None)
    if legacy_dtype is not None and "dtype" not in mesh:
        mesh["dtype"] = legacy_dtype
    roles = {}
    for role in CR_ROLES:
        section = _section((spec.get(role) or {}).get("engine"), f"spec.{role}.engine", role)
        if section:
            roles[role] = section
    for role in ("prefill", "decode", "expert"):
        _check_role(role, mesh, roles.get(role, {}))
    order = [o.name for o in OPTIONS]
    return EngineSpec(
        mesh=dict(sorted(mesh.items(), key=lambda item: order.index(item[0]))),
        roles={role: dict(sorted(v.items(), key=lambda item: order.index(item[0]))) for role, v in roles.items()},
    )


def _section(raw: Any, path: str, role: str | None) -> dict[str, Any]:
    """One section's values by flat name; each key known, settable there, of its type and bounds."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise EngineSpecError(f"{path} must be an object, got {type(raw).__name__}")
    values = {}
    for key, value in raw.items():
        o = BY_CAMEL.get(key)
        if o is None:
            raise EngineSpecError(f"{path}.{key}: not an engine setting (known: {', '.join(BY_CAMEL)})")
        if role is not None and not o.per_role:
            raise EngineSpecError(f"{path}.{key}: one value for the whole mesh; set it in spec.engine.{key}")
        if role is not None and not o.applies_to(role):
            readers = ", ".join(r for r in CR_ROLES if o.applies_to(r))
            raise EngineSpecError(f"{path}.{key}: {role} pods do not read it (read by: {readers})")
        try:
            o.check(o.parse(value))
        except ConfigError as e:
            raise EngineSpecError(e.named(lambda name: f"{path}.{BY_NAME[name].camel}")) from e
        values[o.name] = value
    return values


def _check_role(role: str, mesh: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """What the engine refuses in combination, as `role`'s pods resolve it (own over mesh-wide)."""

    def path(name: str) -> str:
        return f"spec.{role}.engine.{BY_NAME[name].camel}" if name in own else f"spec.engine.{BY_NAME[name].camel}"

    readable: list[Option] = [o for o in CR_OPTIONS if o.applies_to(role)]
    values = {o.name: o.parse({**mesh, **own}[o.name]) for o in readable if o.name in mesh or o.name in own}
    try:
        build(values)
    except ConfigError as e:
        raise EngineSpecError(e.named(path)) from e
