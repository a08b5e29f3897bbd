"""Tool calls without a cluster: the hermes and llama3_json readers (whole and streamed in random
pieces), tool_choice checks, and the Hermes tool prompt for templates that do not render tools."""

from __future__ import annotations

import json
import random

import pytest

from moemesh.router.dispatcher import InvalidRequest
from moemesh.router.tool_calls import ToolRequest, merge_pieces
from moemesh.router.tool_parsers import HermesParser, Llama3JsonParser, parser_for
from moemesh.text.tool_prompt import with_tools

HERMES_REPLY = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "nested": {"brace": "}"}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
EXPECTED = [("get_weather", {"city": "Paris", "nested": {"brace": "}"}}), ("get_time", {})]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def reassemble(pieces: list[dict]) -> tuple[str, list[tuple[str, dict]], set[str]]:
    """Content, calls and ids as an OpenAI client accumulates streamed deltas."""
    content, calls, ids = "", {}, set()
    for delta in pieces:
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls", []):
            call = calls.setdefault(piece["index"], {"name": "", "arguments": ""})
            call["name"] += piece["function"].get("name", "")
            call["arguments"] += piece["function"]["arguments"]
            ids |= {piece["id"]} if "id" in piece else set()
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], ids


def stream_in_random_pieces(parser, text: str, seed: int) -> list[dict]:
    rnd, reader, deltas, i = random.Random(seed), parser.stream(), [], 0
    while i < len(text):
        n = rnd.randint(1, 7)
        deltas.append(merge_pieces(reader.feed(text[i : i + n], i + n >= len(text))))
        i += n
    return deltas


def test_hermes_reads_every_call_and_the_text_before_them():
    content, calls = HermesParser().parse(HERMES_REPLY)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert HermesParser().parse("no calls <tool_call> here") == ("no calls <tool_call> here", [])


@pytest.mark.parametrize("seed", range(20))
def test_hermes_streamed_in_any_pieces_reassembles_to_the_same_calls(seed):
    content, calls, ids = reassemble(stream_in_random_pieces(HermesParser(), HERMES_REPLY, seed))
    assert content.strip() == "Let me look." and calls == EXPECTED and len(ids) == 2


def test_hermes_gives_back_text_that_only_looks_like_a_tag():
    content, calls, _ = reassemble(stream_in_random_pieces(HermesParser(), "a <tool_callx> b <tool", 0))
    assert (content, calls) == ("a <tool_callx> b <tool", [])


def test_llama3_json_reads_semicolon_separated_calls_and_leaves_text_alone():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    _, calls = Llama3JsonParser().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert reassemble(stream_in_random_pieces(Llama3JsonParser(), text, 1))[1] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
    assert reassemble(stream_in_random_pieces(Llama3JsonParser(), "Just text.", 1))[0] == "Just text."
    assert isinstance(parser_for("auto", "{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert isinstance(parser_for("auto", "{{ messages }}"), HermesParser)


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (None, "required", "needs tools"),
        ([TOOL], "sometimes", "must be"),
        ([TOOL], {"type": "function", "function": {"name": "nope"}}, "must name"),
        ([{"type": "function", "function": {}}], "auto", r"tools\[0\]"),
    ],
)
def test_bad_tools_or_tool_choice_are_rejected_naming_the_field(tools, choice, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        ToolRequest(tools, choice, True, HermesParser())
    assert e.value.param in ("tools", "tool_choice")


def test_required_and_named_choices_constrain_the_output_to_the_calls_schema():
    required = json.loads(ToolRequest([TOOL], "required", False, HermesParser()).constraint().spec)
    assert (required["minItems"], required["maxItems"]) == (1, 1)
    assert required["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    named = ToolRequest([TOOL], {"type": "function", "function": {"name": "get_weather"}}, True, HermesParser())
    assert json.loads(named.constraint().spec) == {"type": "object"}
    assert named.parse('{"city": "Oslo"}')[1][0].arguments == '{"city": "Oslo"}'
    assert ToolRequest([TOOL], "auto", True, HermesParser()).constraint() is None


def test_the_hermes_tool_prompt_lists_tools_and_renders_calls_and_results():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    rendered, extra = with_tools(messages, [TOOL], "{{ messages }}")  # a template that knows no tools
    assert (
        extra == {}
        and rendered[0]["content"].startswith("Be brief.\n\n")
        and json.dumps(TOOL) in rendered[0]["content"]
    )
    call = rendered[2]["content"]
    assert call.startswith("<tool_call>\n") and json.loads(call.split("\n")[1]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\n18 C\n</tool_response>"}
    native, extra = with_tools(messages, [TOOL], "{% for t in tools %}{% endfor %}")
    assert extra == {"tools": [TOOL]} and native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
