"""Tool calls written by the model in its own format -> OpenAI tool calls (`tool_choice: auto`).

Two formats, picked by `--tool-call-parser` (`auto`: from the model's chat template):
- `hermes` (Hermes, Qwen, and moemesh's own tool prompt for templates without tools, see
  text/tool_prompt.py): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any
  text outside them is the message content;
- `llama3_json` (Llama 3.1+): the whole reply is `{"name": ..., "parameters": {...}}`, several
  calls separated by `;`.

`parse(text)` reads a finished reply; `stream()` gives a per-choice incremental parser whose
`feed(delta, finished)` returns OpenAI delta pieces: `{"content": ...}` or a tool-call piece
`{"index", "id", "type", "function": {"name", "arguments": ""}}` first, then
`{"index", "function": {"arguments": piece}}` as the arguments are generated (hermes streams the
arguments' text as it comes; llama3_json sends each call whole at the end).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_pieces(index: int, call: ToolCall) -> list[dict]:
    """The streamed pieces of one whole call: name first, then its arguments."""
    head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [head, {"index": index, "function": {"arguments": call.arguments}}]


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = [c for body in self._BLOCK.findall(text) if (c := _call_from_json(body.strip(), "arguments"))]
        if not calls:
            return text, []
        content = text[: text.index(self.OPEN)].strip()
        return content or None, calls

    def stream(self) -> HermesStream:
        return HermesStream()


class HermesStream:
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def __init__(self):
        self.text = ""
        self.pos = 0  # text[:pos] is handled
        self.in_call = False
        self.call: ToolCall | None = None  # the open call, once its name is known
        self.num_calls = 0
        self.args_sent = 0  # characters of the open call's arguments sent

    def feed(self, delta: str, finished: bool) -> list[dict]:
        self.text += delta
        pieces: list[dict] = []
        while True:
            before = self.pos
            pieces += self._call_step(finished) if self.in_call else self._text_step(finished)
            if self.pos == before:
                return pieces

    def _text_step(self, finished: bool) -> list[dict]:
        start = self.text.find(HermesParser.OPEN, self.pos)
        if start < 0:
            end = len(self.text)
            if not finished:  # hold back what may begin the tag
                for k in range(min(len(HermesParser.OPEN) - 1, end - self.pos), 0, -1):
                    if HermesParser.OPEN.startswith(self.text[end - k :]):
                        end -= k
                        break
            content, self.pos = self.text[self.pos : end], end
            return [{"content": content}] if content else []
        content = self.text[self.pos : start]
        self.pos, self.in_call = start + len(HermesParser.OPEN), True
        return [{"content": content}] if content.strip() else []

    def _call_step(self, finished: bool) -> list[dict]:
        body = self.text[self.pos :]
        pieces = []
        if self.call is None:
            head = self._HEAD.match(body)
            if head is None:
                if finished or HermesParser.CLOSE in body:  # not a call we can read: give it back as text
                    self.in_call, self.pos = False, len(self.text)
                    return [{"content": HermesParser.OPEN + body}]
                return []
            self.call = ToolCall(json.loads(f'"{head.group(1)}"'), "")
            self.pos += head.end()
            body = self.text[self.pos :]
            pieces += call_pieces(self.num_calls, self.call)[:1]
        close = body.find(HermesParser.CLOSE)
        if close >= 0 or finished:
            tail = body[:close] if close >= 0 else body
            arguments = tail[: tail.rfind("}")] if tail.count("}") else tail  # drop the call's own closing brace
            pieces += self._arguments(arguments)
            self.call.arguments = arguments
            self.pos += close + len(HermesParser.CLOSE) if close >= 0 else len(body)
            self.num_calls += 1
            self.call, self.args_sent, self.in_call = None, 0, False
            return pieces or [{"index": self.num_calls - 1, "function": {"arguments": ""}}]
        last_brace = body.rfind("}")  # text before the last '}' is surely part of the arguments
        if last_brace > self.args_sent:
            pieces += self._arguments(body[:last_brace])
        return pieces

    def _arguments(self, arguments: str) -> list[dict]:
        piece, self.args_sent = arguments[self.args_sent :], len(arguments)
        return [{"index": self.num_calls, "function": {"arguments": piece}}] if piece else []


class Llama3JsonParser:
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip().removeprefix("<|python_tag|>")
        if not stripped.startswith("{"):
            return text, []
        calls = [_call_from_json(part, "parameters") for part in stripped.split(";")]
        found = [c for c in calls if c is not None]
        if not found or len(found) < len(calls):
            return text, []
        return None, found

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self)


class Llama3JsonStream:
    """Text that does not open with `{` streams as content; a JSON reply is read when finished."""

    def __init__(self, parser: Llama3JsonParser):
        self.parser = parser
        self.text = ""
        self.buffering: bool | None = None

    def feed(self, delta: str, finished: bool) -> list[dict]:
        self.text += delta
        if self.buffering is None and self.text.strip():
            self.buffering = self.text.strip().startswith(("{", "<|python_tag|>"))
            delta = self.text
        if not self.buffering:
            return [{"content": delta}] if delta and self.buffering is False else []
        if not finished:
            return []
        content, calls = self.parser.parse(self.text)
        if not calls:
            return [{"content": content}]
        return [piece for i, call in enumerate(calls) for piece in call_pieces(i, call)]


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
PARSER_NAMES = ("auto", *PARSERS)


def parser_for(name: str, chat_template: str | None):
    """`auto`: llama3_json for a Llama 3 template (it mentions <|python_tag|>), else hermes
    (Hermes/Qwen templates, and moemesh's own tool prompt)."""
    if name == "auto":
        name = "llama3_json" if chat_template and "<|python_tag|>" in chat_template else "hermes"
    return PARSERS[name]()
