"""The structured-output fields of an OpenAI/vLLM request -> one `StructuredOutputSpec`
(contracts/sampling.py; the dispatcher sends it in the workers' proto).

Accepted (at most one constraint per request):
- OpenAI `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`;
- vLLM's extras `guided_json` (schema object or text), `guided_regex`, `guided_choice`,
  `guided_grammar`, and its newer `structured_outputs: {json, regex, choice, grammar}`.

The router only checks the shape; the workers compile the grammar against their vocabulary
(engine/runner/structured_output.py) and a bad schema, regex or grammar comes back as a 400 naming the
field. This keeps xgrammar (which imports torch) out of the router.
"""

from __future__ import annotations

import json

from moemesh.contracts.sampling import StructuredOutputSpec
from moemesh.router.dispatcher import InvalidRequest


def structured_output(
    response_format: dict | None,
    guided: dict[str, object],  # guided_json / guided_regex / guided_choice / guided_grammar, None when unset
    structured_outputs: dict | None,
) -> StructuredOutputSpec | None:
    found: list[tuple[str, StructuredOutputSpec]] = []
    if response_format is not None:
        message = _response_format(response_format)
        if message is not None:
            found.append(("response_format", message))
    for name, value in guided.items():
        if value is not None:
            found.append((name, _constraint(name.removeprefix("guided_"), value, name)))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        for key, value in structured_outputs.items():
            if key in ("json", "regex", "choice", "grammar") and value is not None:
                found.append(("structured_outputs", _constraint(key, value, "structured_outputs")))
            elif key == "json_object" and value:
                found.append(("structured_outputs", StructuredOutputSpec("json_object")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequest(f"give at most one output constraint, got {names}", param=found[1][0])
    return found[0][1] if found else None


def _response_format(response_format: dict) -> StructuredOutputSpec | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest(
                "response_format.json_schema must be an object with a 'schema' object", param="response_format"
            )
        if not isinstance(spec.get("name", ""), str):
            raise InvalidRequest("response_format.json_schema.name must be a string", param="response_format")
        # no schema: any JSON object (OpenAI requires one; vLLM allows its absence)
        schema = spec.get("schema") or {"type": "object"}
        return StructuredOutputSpec("json", json.dumps(schema))
    raise InvalidRequest("response_format.type must be 'text', 'json_object' or 'json_schema'", param="response_format")


def _constraint(kind: str, value: object, param: str) -> StructuredOutputSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidRequest(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(value, dict):
            raise InvalidRequest("the JSON schema must be an object", param=param)
        return StructuredOutputSpec("json", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest("choice must be a non-empty list of non-empty strings", param=param)
        return StructuredOutputSpec("choice", choices=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{kind} must be a non-empty string", param=param)
    return StructuredOutputSpec(kind, value)  # regex or grammar
