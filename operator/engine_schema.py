"""The schema of the InferenceMesh's engine settings, generated from the one config definition
(`moemesh.runtime.engine_config`): `spec.engine` and `spec.<role>.engine` in the CRD
(OpenAPI v3, Kubernetes' structural subset) and `mesh.engine` / `mesh.<role>.engine` in the chart's
values.schema.json (JSON Schema draft-07).

    python -m moemesh.operator.engine_schema [CHART_DIR] [--check]

rewrites the generated parts of both files (between the CRD's `# BEGIN generated` / `# END
generated` lines; values.schema.json's `definitions.engine` and `definitions.roleEngine`), or with
--check exits 1 when they differ from the definition (a test does the same).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Any

from moemesh.operator.engine_spec import CR_OPTIONS, CR_ROLES
from moemesh.runtime.engine_config import Option

CHART = pathlib.Path(__file__).resolve().parents[1] / "charts" / "moemesh"
CRD = pathlib.Path("crds") / "inferencemeshes.moemesh.io.yaml"
VALUES_SCHEMA = pathlib.Path("values.schema.json")
OPENAPI, DRAFT7 = "openapi", "draft-07"
_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
MESH_DOC = (
    "Engine settings of every pod that reads them, as `moemesh serve` takes them (--kv-memory-gib: "
    "kvMemoryGib); a role's own engine settings win over these."
)
ROLE_DOC = "This role's own engine settings, over spec.engine's (only those a role may set alone)."


def description(o: Option, per_role: bool) -> str:
    readers = ", ".join(r for r in CR_ROLES if o.applies_to(r))
    scope = "" if o.per_role or per_role else " One value for the whole mesh."
    return f"{o.doc[0].upper()}{o.doc[1:]}. Read by: {readers}.{scope}"


def property_schema(o: Option, dialect: str, per_role: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string" if o.choices is not None else _TYPES[o.kind]}
    if o.choices is not None:
        schema["enum"] = list(o.choices)
    if o.minimum is not None:
        schema["minimum"] = o.minimum
    if o.maximum is not None:
        schema["maximum"] = o.maximum
    if o.above is not None:
        schema.update(
            {"minimum": o.above, "exclusiveMinimum": True} if dialect == OPENAPI else {"exclusiveMinimum": o.above}
        )
    if o.pattern is not None:
        schema["pattern"] = f"^({o.pattern})$"
    schema["description"] = description(o, per_role)
    return schema


def engine_schema(dialect: str = OPENAPI, per_role: bool = False) -> dict[str, Any]:
    """The schema of spec.engine (`per_role`: of spec.<role>.engine, the options a role may set alone)."""
    options = [o for o in CR_OPTIONS if o.per_role or not per_role]
    schema: dict[str, Any] = {"type": "object", "description": ROLE_DOC if per_role else MESH_DOC}
    if dialect == DRAFT7:
        schema["additionalProperties"] = False
    schema["properties"] = {o.camel: property_schema(o, dialect, per_role) for o in options}
    return schema


# -- the CRD's YAML ----------------------------------------------------------------------------------

_BLOCK = re.compile(r"^( *)# BEGIN generated (\S+)[^\n]*\n.*?^\1# END generated\n", re.MULTILINE | re.DOTALL)
_HINT = "(python -m moemesh.operator.engine_schema; edit moemesh.runtime.engine_config instead)"
_PLAIN = re.compile(r"[a-z][a-z0-9]*")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}  # YAML 1.1 reads these as bool/null


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, str):
        return value if _PLAIN.fullmatch(value) and value not in _YAML_WORDS else json.dumps(value)
    return repr(value)


def yaml_block(indent: str, which: str) -> str:
    """The CRD's generated block `which` ("spec.engine" or "spec.<role>.engine") at `indent`."""
    schema = engine_schema(OPENAPI, per_role=which != "spec.engine")
    lines = [
        f"{indent}# BEGIN generated {which} {_HINT}",
        f"{indent}engine:",
        f"{indent}  type: object",
        f"{indent}  description: {_scalar(schema['description'])}",
        f"{indent}  properties:",
    ]
    for key, prop in schema["properties"].items():
        lines.append(f"{indent}    {key}: {{{', '.join(f'{k}: {_scalar(v)}' for k, v in prop.items())}}}")
    return "\n".join([*lines, f"{indent}# END generated", ""])


def rewrite_crd(text: str) -> str:
    return _BLOCK.sub(lambda m: yaml_block(m.group(1), m.group(2)), text)


def rewrite_values_schema(text: str) -> str:
    schema = json.loads(text)
    schema["definitions"]["engine"] = engine_schema(DRAFT7)
    schema["definitions"]["roleEngine"] = engine_schema(DRAFT7, per_role=True)
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moemesh.operator.engine_schema", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("chart", nargs="?", default=str(CHART), help="the chart directory (default: this checkout's)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from the definition")
    args = parser.parse_args(argv)
    stale = []
    for path, rewrite in (
        (pathlib.Path(args.chart) / CRD, rewrite_crd),
        (pathlib.Path(args.chart) / VALUES_SCHEMA, rewrite_values_schema),
    ):
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if stale:
        print(("stale: " if args.check else "rewrote: ") + ", ".join(stale), file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
