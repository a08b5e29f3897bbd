"""Tools on a chat request: `tool_choice` -> an output constraint and a reply reader.

- `none`: the tools are not put in the prompt and the reply is plain text;
- `auto`: the tools are in the prompt; the model's own tool-call format is parsed
  (router/tool_parsers.py, `--tool-call-parser`);
- `required`: the reply is constrained (structured outputs) to a JSON array of one or more
  `{"name", "parameters"}` calls of the given tools (at most one with `parallel_tool_calls`
  false), as vLLM does; streamed calls are sent once the array is complete;
- a named function: the reply is constrained to that function's parameters schema, and its
  text is the call's arguments (streamed as they are generated).
"""

from __future__ import annotations

import json

from moemesh.contracts.sampling import StructuredOutputSpec
from moemesh.router.dispatcher import InvalidRequest
from moemesh.router.tool_parsers import ToolCall, call_pieces


class ToolRequest:
    def __init__(self, tools: list | None, tool_choice: str | dict | None, parallel_tool_calls: bool, parser):
        self.functions = _functions(tools or [])
        self.parallel = parallel_tool_calls
        self.parser = parser
        self.named: str | None = None
        choice = tool_choice if tool_choice is not None else ("auto" if self.functions else "none")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in self.functions:
                raise InvalidRequest("tool_choice must name a function of `tools`", param="tool_choice")
            self.named, choice = name, "named"
        elif choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice"
            )
        elif choice != "none" and not self.functions:
            raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
        self.choice = choice

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def prompt_tools(self) -> list[dict] | None:
        return [{"type": "function", "function": f} for f in self.functions.values()] if self.active else None

    def constraint(self) -> StructuredOutputSpec | None:
        if self.named is not None:  # choice "named"
            return StructuredOutputSpec("json", json.dumps(_parameters(self.functions[self.named])))
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(f)},
                    "required": ["name", "parameters"],
                }
                for name, f in self.functions.items()
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputSpec("json", json.dumps(schema))
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply."""
        if self.named is not None:  # choice "named"
            return None, [ToolCall(self.named, text)]
        if self.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut by max_tokens
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        content, calls = self.parser.parse(text)
        return content, calls if self.parallel else calls[:1]

    def stream(self):
        """A per-choice reader: `feed(delta, finished)` -> OpenAI delta pieces."""
        if self.named is not None:  # choice "named"
            return _NamedStream(self.named)
        if self.choice == "required":
            return _WholeStream(self)
        return self.parser.stream()

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI reports `tool_calls` when the model chose to call (not for a named function)."""
        return "tool_calls" if has_calls and reason == "stop" and self.choice != "named" else reason


class _NamedStream:
    def __init__(self, name: str):
        self.call = ToolCall(name, "")
        self.started = False

    def feed(self, delta: str, finished: bool) -> list[dict]:
        pieces = [] if self.started else call_pieces(0, self.call)[:1]
        self.started = True
        return pieces + ([{"index": 0, "function": {"arguments": delta}}] if delta else [])


class _WholeStream:
    def __init__(self, request: ToolRequest):
        self.request = request
        self.text = ""

    def feed(self, delta: str, finished: bool) -> list[dict]:
        self.text += delta
        if not finished:
            return []
        content, calls = self.request.parse(self.text)
        if not calls:
            return [{"content": content}] if content else []
        return [piece for i, call in enumerate(calls) for piece in call_pieces(i, call)]


def merge_pieces(pieces: list[dict]) -> dict:
    """One OpenAI `delta` from parser pieces: content joined, one tool_calls entry per index."""
    delta: dict = {}
    content = "".join(p["content"] for p in pieces if "content" in p)
    if content:
        delta["content"] = content
    calls: dict[int, dict] = {}
    for p in pieces:
        if "index" not in p:
            continue
        entry = calls.get(p["index"])
        if entry is None:
            calls[p["index"]] = {**p, "function": dict(p["function"])}
        else:
            entry["function"]["arguments"] = entry["function"].get("arguments", "") + p["function"]["arguments"]
    if calls:
        delta["tool_calls"] = list(calls.values())
    return delta


def _functions(tools: list) -> dict[str, dict]:
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}", param="tools"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        functions[function["name"]] = function
    return functions


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}
