"""Tools in a chat prompt, for chat templates that do not render them.

A template that mentions `tools` gets the OpenAI tools and messages as they are (arguments of
assistant tool calls as objects, as Hugging Face templates expect). Otherwise (SmolLM2's
template renders only role + content) moemesh writes the conversation in the Hermes / Qwen
style itself, which the router's `hermes` tool parser reads back:

- a system message listing the tools' JSON signatures inside <tools></tools> and asking for each
  call as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (appended to the caller's own
  system message, if any);
- an assistant message with `tool_calls` becomes its text followed by one <tool_call> block per call;
- a `tool` message becomes <tool_response>{content}</tool_response> in a `tool` turn.
"""

from __future__ import annotations

import json

_SYSTEM = (
    "You can call functions. Their signatures are listed as JSON inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


def template_renders_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def with_tools(messages: list[dict], tools: list[dict] | None, chat_template: str | None) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for rendering `messages` with `tools`."""
    if template_renders_tools(chat_template):
        return [_arguments_as_objects(m) for m in messages], ({"tools": tools} if tools else {})
    rendered = [_hermes_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = _SYSTEM.format(tools=listing)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _hermes_message(message: dict) -> dict:
    role, content = message["role"], message.get("content")
    if role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        blocks = []
        for call in calls:
            function = call.get("function", {})
            arguments = function.get("arguments", "{}")
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
            blocks.append(f"<tool_call>\n{body}\n</tool_call>")
        return {"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)}
    return {"role": role, "content": content or ""}


def _arguments_as_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}
