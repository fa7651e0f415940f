"""Tool-call parsers on outputs written from each format's published spec,
non-stream and streamed, split at every possible boundary."""
from __future__ import annotations

import json

import pytest

from services.tokenizer.parsers import PARSERS, detect_tool_parser
from services.tokenizer.parsers.base import merge_calls

QWEN_TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius", "days": [1, 2], "q": "a}\\"b"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "list_orders", "arguments": {}}\n'
    "</tool_call>"
)
QWEN_ARGS_FIRST = '<tool_call>\n{"arguments": {"order_id": "12345"}, "name": "get_delivery_date"}\n</tool_call>'
DEEPSEEK_R1 = (
    "Let me look that up."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_delivery_date\n"
    '```json\n{"order_id": "12345"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>ping\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
DEEPSEEK_V31 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_delivery_date<｜tool▁sep｜>"
    '{"order_id": "12345"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
GLM3 = "get_weather\n```python\ntool_call(location='北京', unit='celsius', days=3)\n```"

CASES = [
    ("hermes", QWEN_TWO_CALLS, "I'll check both.\n",
     [("get_weather", {"city": "北京", "unit": "celsius", "days": [1, 2], "q": 'a}"b'}), ("list_orders", {})]),
    ("hermes", QWEN_ARGS_FIRST, "", [("get_delivery_date", {"order_id": "12345"})]),
    ("deepseek_v3", DEEPSEEK_R1, "Let me look that up.",
     [("get_delivery_date", {"order_id": "12345"}), ("ping", {})]),
    ("deepseek_v3", DEEPSEEK_V31, "", [("get_delivery_date", {"order_id": "12345"})]),
    ("chatglm3", GLM3, "", [("get_weather", {"location": "北京", "unit": "celsius", "days": 3})]),
]


def stream(parser_name: str, pieces: list[str]):
    parser = PARSERS[parser_name][0]()
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        deltas += out.tool_calls
    out = parser.flush()
    return content + out.content, deltas + out.tool_calls


def check_calls(calls, expected):
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.id.startswith("call_") and len(c.id) == 13 for c in calls)


@pytest.mark.parametrize("parser_name, text, content, expected", CASES)
def test_non_stream(parser_name, text, content, expected):
    got_content, calls = PARSERS[parser_name][1](text)
    assert got_content == content
    check_calls(calls, expected)


@pytest.mark.parametrize("parser_name, text, content, expected", CASES)
def test_stream_split_at_every_boundary(parser_name, text, content, expected):
    for cut in range(len(text) + 1):
        got_content, deltas = stream(parser_name, [text[:cut], text[cut:]])
        assert got_content == content, cut
        check_calls(merge_calls(deltas), expected)


@pytest.mark.parametrize("parser_name, text, content, expected", CASES)
def test_stream_character_by_character_has_openai_delta_shape(parser_name, text, content, expected):
    got_content, deltas = stream(parser_name, list(text))
    assert got_content == content
    check_calls(merge_calls(deltas), expected)
    # The streamed arguments are the very text a non-stream reply carries.
    assert [c.arguments for c in merge_calls(deltas)] == [c.arguments for c in PARSERS[parser_name][1](text)[1]]
    seen = set()
    for d in deltas:
        if d.index not in seen:  # the first delta of a call names it
            assert d.id and d.name and d.arguments == ""
            seen.add(d.index)
        else:
            assert d.id is None and d.name is None
    assert sorted(seen) == list(range(len(expected)))


@pytest.mark.parametrize("parser_name", ["hermes", "deepseek_v3", "chatglm3"])
def test_plain_text_is_content(parser_name):
    text = "\nThe weather is fine; no tool needed. Use <tool or ``` freely."
    got, deltas = stream(parser_name, list(text))
    assert deltas == []
    assert got == (text.lstrip("\n") if parser_name == "chatglm3" else text)
    assert PARSERS[parser_name][1](text)[1] == []


def test_invalid_qwen_block_means_no_calls():
    text = 'Sure <tool_call>{"name": "x", "arguments": {bad}}</tool_call>'
    content, calls = PARSERS["hermes"][1](text)
    assert calls == [] and content == text


def test_detection():
    assert detect_tool_parser("qwen3", None) == "hermes"
    assert detect_tool_parser("llama", "{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_parser("deepseek_v3", None) == "deepseek_v3"
    assert detect_tool_parser("chatglm", None) == "chatglm3"
    assert detect_tool_parser("llama", "plain") is None
