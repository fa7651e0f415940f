"""Request validation: documented edges are accepted, everything else is a
422 whose message names the field and the rule."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from services.http_edge.errors import EdgeError
from services.common.chat_protocol import INT32_MAX, UINT64_MAX
from services.http_edge.serving import parse_chat_request

USER = {"role": "user", "content": "hi"}
BASE: dict[str, Any] = {"model": "m", "messages": [USER]}
TOOL = {"type": "function", "function": {"name": "get_date", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_date", "arguments": "{}"}}


def body(**fields: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out.update(fields)
    return out


def parse(data: dict[str, Any]):
    import json

    return parse_chat_request(json.dumps(data).encode())


def image(i: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": f"/data/multimodal_inputs/{i}.png"}


VALID = [
    ("temperature 0", body(temperature=0)),
    ("temperature 2", body(temperature=2.0)),
    ("top_p 1", body(top_p=1)),
    ("top_p tiny", body(top_p=1e-9)),
    ("top_k 0 (docs)", body(top_k=0)),
    ("top_k -1 (vLLM)", body(top_k=-1)),
    ("top_k int32 max", body(top_k=INT32_MAX)),
    ("seed 0", body(seed=0)),
    ("seed uint64 max", body(seed=UINT64_MAX)),
    ("penalties at bounds", body(presence_penalty=-2, frequency_penalty=2.0)),
    ("repetition_penalty 2", body(repetition_penalty=2)),
    ("repetition_penalty small", body(repetition_penalty=0.01)),
    ("max_tokens 1", body(max_tokens=1)),
    ("max_tokens int32 max", body(max_tokens=INT32_MAX)),
    ("top_logprobs 0..20", body(logprobs=True, top_logprobs=20)),
    ("top_logprobs alone", body(top_logprobs=0)),
    ("n and best_of 128", body(n=128, best_of=128, temperature=0.5)),
    ("beam search skips best_of checks", body(use_beam_search=True, n=4, best_of=2)),
    ("stop 1024 chars", body(stop="x" * 1024)),
    ("stop 32 x 1024 chars", body(stop=["x" * 1024] * 32)),
    ("stop 1024 items", body(stop=["s"] * 1024)),
    ("stop empty list", body(stop=[])),
    ("nulls are absent", body(seed=None, temperature=None, stop=None, tools=None, n=None, best_of=None,
                              top_logprobs=None, tool_choice=None, chat_template_kwargs=None)),
    ("unknown fields", body(user="u", logit_bias={"1": 2}, max_completion_tokens=3)),
    ("model name charset", body(model="Qwen2.5-7B_Instruct." + "a" * 236)),
    ("all roles", body(messages=[{"role": "system", "content": ""}, USER,
                                 {"role": "assistant", "content": "ok", "name": "bot"}, USER])),
    ("media parts, both url forms", body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, image(0),
        {"type": "image_url", "image_url": {"url": "http://x/a.png", "detail": "low"}},
        {"type": "video_url", "video_url": "/v.mp4"}, {"type": "audio_url", "audio_url": "/a.wav"}]}])),
    ("part type inferred", body(messages=[{"role": "user", "content": [{"text": "hi"}]}])),
    ("20 media parts", body(messages=[{"role": "user", "content": [image(i) for i in range(20)]}])),
    ("tool round trip", body(tools=[TOOL], tool_choice="auto", messages=[
        USER, {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "content": "2024-09-10", "tool_call_id": "call_1"}])),
    ("assistant null content with tool_calls", body(messages=[USER, {"role": "assistant", "content": None,
                                                                    "tool_calls": [CALL]}])),
    ("tool_choice none", body(tool_choice="none")),
    ("tool_choice required", body(tools=[TOOL], tool_choice="required")),
    ("tool_choice named", body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_date"}})),
    ("response_format json_object", body(response_format={"type": "json_object"})),
    ("response_format json_schema", body(response_format={"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}})),
    ("chat_template_kwargs", body(chat_template_kwargs={"enable_thinking": False, "thinking_budget": 64})),
    ("stream_options", body(stream=True, stream_options={"include_usage": True})),
    ("stream_options include_usage false", body(stream=True, stream_options={"include_usage": False})),
    ("stream_options empty", body(stream=True, stream_options={})),
    ("stream_options without stream (ignored)", body(stream_options={"include_usage": True})),
    ("booleans", body(include_stop_str_in_output=True, skip_special_tokens=False, ignore_eos=True,
                      use_beam_search=False, logprobs=False, stream=False)),
    ("stop_token_ids empty", body(stop_token_ids=[])),
    ("tool strict and description", body(tools=[{"type": "function", "function": {
        "name": "get_date", "description": "d", "strict": True, "parameters": {"type": "object",
                                                                             "properties": {}}}}])),
    ("assistant prefix and reasoning alias", body(messages=[USER, {"role": "assistant", "content": "Sure",
                                                                   "prefix": True, "reasoning": "think"}])),
]


@pytest.mark.parametrize("case,data", VALID, ids=[c for c, _ in VALID])
def test_documented_values_are_accepted(case: str, data: dict[str, Any]) -> None:
    parse(data)


def test_normalisation() -> None:
    request = parse(body(stop="end", stop_token_ids=[2, 13, 2, -1, 2**31, 7]))
    assert request.stop == ["end"]
    assert request.stop_token_ids == [2, 13, 7]  # out-of-int32 ids ignored, duplicates dropped
    assert parse(body(stop=[])).stop is None
    assert parse(body(messages=[USER, {"role": "assistant", "content": "a", "reasoning": "r"}])).messages[
        1
    ].reasoning_content == "r"
    assert parse(body(top_logprobs=3)).wants_logprobs
    assert not parse(body(logprobs=False)).wants_logprobs


INVALID = [
    ("temperature low", body(temperature=-0.01), "temperature must be in [0, 2]"),
    ("temperature high", body(temperature=2.01), "temperature must be in [0, 2]"),
    ("temperature string", body(temperature="hot"), "temperature must be a number"),
    ("temperature bool", body(temperature=True), "temperature must be a number"),
    ("temperature numeric string", body(temperature="1"), "temperature must be a number"),
    ("top_p 0", body(top_p=0), "top_p must be in (0, 1]"),
    ("top_p above 1", body(top_p=1.01), "top_p must be in (0, 1]"),
    ("top_k -2", body(top_k=-2), "top_k must be -1 (disabled) or in [0, 2147483647]"),
    ("top_k above int32", body(top_k=2**31), "top_k must be -1 (disabled) or in [0, 2147483647]"),
    ("top_k float", body(top_k=1.5), "top_k must be an integer"),
    ("top_k whole float", body(top_k=5.0), "top_k must be an integer"),
    ("top_k bool", body(top_k=True), "top_k must be an integer"),
    ("seed negative", body(seed=-1), "seed must be in [0, 18446744073709551615]"),
    ("seed above uint64", body(seed=2**64), "seed must be in [0, 18446744073709551615]"),
    ("presence_penalty", body(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", body(frequency_penalty=-3), "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty 0", body(repetition_penalty=0), "repetition_penalty must be in (0, 2]"),
    ("repetition_penalty high", body(repetition_penalty=2.1), "repetition_penalty must be in (0, 2]"),
    ("max_tokens 0", body(max_tokens=0), "max_tokens must be in (0, 2147483647]"),
    ("max_tokens above int32", body(max_tokens=2**31), "max_tokens must be in (0, 2147483647]"),
    ("max_tokens float", body(max_tokens=10.0), "max_tokens must be an integer"),
    ("top_logprobs 21", body(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20]"),
    ("top_logprobs without logprobs", body(logprobs=False, top_logprobs=2), "top_logprobs needs logprobs"),
    ("logprobs string", body(logprobs="true"), "logprobs must be a boolean"),
    ("n 0", body(n=0), "n must be in [1, 128]"),
    ("n 129", body(n=129, temperature=1), "n must be in [1, 128]"),
    ("best_of 129", body(best_of=129, temperature=1), "best_of must be in [1, 128]"),
    ("n > 1 needs temperature", body(n=2), "needs a temperature > 0"),
    ("n > 1 greedy", body(n=2, temperature=0), "needs a temperature > 0"),
    ("best_of < n", body(n=3, best_of=2, temperature=1), "best_of must be >= n"),
    ("stream best_of != n", body(stream=True, best_of=2, temperature=1), "best_of must equal n"),
    ("stop empty string", body(stop=""), "stop strings must be 1-1024 characters"),
    ("stop empty item", body(stop=["a", ""]), "stop strings must be 1-1024 characters"),
    ("stop long item", body(stop=["x" * 1025]), "stop strings must be 1-1024 characters"),
    ("stop too many", body(stop=["s"] * 1025), "stop must have at most 1024 items"),
    ("stop total", body(stop=["x" * 1024] * 33), "stop must total at most 32768 characters"),
    ("stop number", body(stop=5), "stop must be a string or a list of strings"),
    ("stop list of numbers", body(stop=[1]), "stop[0] must be a string"),
    ("stop_token_ids not list", body(stop_token_ids="2"), "stop_token_ids must be a list"),
    ("stop_token_ids float", body(stop_token_ids=[1.5]), "stop_token_ids[0] must be an integer"),
    ("stream string", body(stream="yes"), "stream must be a boolean"),
    ("stream int", body(stream=1), "stream must be a boolean"),
    ("ignore_eos int", body(ignore_eos=0), "ignore_eos must be a boolean"),
    ("model missing", {"messages": [USER]}, "model is required"),
    ("model null", body(model=None), "model is required"),
    ("model empty", body(model=""), "model must be 1-256 characters of [a-zA-Z0-9_.-]"),
    ("model charset", body(model="my model"), "model must be 1-256 characters"),
    ("model too long", body(model="a" * 257), "model must be 1-256 characters"),
    ("model number", body(model=5), "model must be a string"),
    ("messages missing", {"model": "m"}, "messages is required"),
    ("messages empty", body(messages=[]), "messages must not be empty"),
    ("messages string", body(messages="hi"), "messages must be a list"),
    ("message not object", body(messages=["hi"]), "messages[0] must be an object"),
    ("role unknown", body(messages=[{"role": "bot", "content": "x"}]), "messages[0].role must be one of"),
    ("role missing", body(messages=[{"content": "x"}]), "messages[0].role is required"),
    ("user without content", body(messages=[{"role": "user"}]), "content is required for role user"),
    ("user null content", body(messages=[{"role": "user", "content": None}]), "content is required"),
    ("content number", body(messages=[{"role": "user", "content": 5}]),
     "messages[0].content must be a string or a list of parts"),
    ("content empty list", body(messages=[{"role": "user", "content": []}]), "content must not be an empty list"),
    ("empty text part", body(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]),
     "messages[0].content[0]: a text part needs a non-empty text"),
    ("text part not string", body(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]),
     "messages[0].content[0].text must be a string"),
    ("media part without media", body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]: a part of type image_url needs a non-null image_url"),
    ("part type unknown", body(messages=[{"role": "user", "content": [{"type": "file", "text": "x"}]}]),
     "messages[0].content[0].type must be one of"),
    ("21 media parts", body(messages=[{"role": "user", "content": [image(i) for i in range(11)]},
                                      {"role": "user", "content": [image(i) for i in range(10)]}]),
     "at most 20 media parts, got 21"),
    ("tool without id", body(messages=[USER, {"role": "tool", "content": "x"}]),
     "messages[1]: tool_call_id must be a non-empty string for role tool"),
    ("tool empty id", body(messages=[USER, {"role": "tool", "content": "x", "tool_call_id": ""}]),
     "tool_call_id must be a non-empty string"),
    ("assistant empty", body(messages=[USER, {"role": "assistant", "content": ""}]),
     "content must not be empty for role assistant"),
    ("assistant missing content", body(messages=[USER, {"role": "assistant"}]),
     "content must not be empty for role assistant"),
    ("tool_call bad type", body(messages=[USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "x"}]}]),
     "messages[1].tool_calls[0].type must be one of 'function'"),
    ("tool_call arguments object", body(messages=[USER, {"role": "assistant", "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": {}}}]}]),
     "messages[1].tool_calls[0].function.arguments must be a string"),
    ("tools with empty user content", body(tools=[TOOL], messages=[{"role": "user", "content": ""}]),
     "messages[0].content must not be empty when tools are given"),
    ("tool type", body(tools=[{**TOOL, "type": "retrieval"}]), "tools[0].type must be one of 'function'"),
    ("tool name charset", body(tools=[{"type": "function", "function": {"name": "get date"}}]),
     "tools[0].function.name must be 1-64 characters"),
    ("tool_choice string", body(tool_choice="maybe"), "tool_choice must be one of 'none', 'auto' or 'required'"),
    ("tool_choice object without function", body(tool_choice={"type": "function"}),
     "tool_choice.function is required"),
    ("tool_choice number", body(tool_choice=1), "tool_choice must be a string or an object"),
    ("response_format type", body(response_format={"type": "xml"}), "response_format.type must be one of"),
    ("json_schema missing", body(response_format={"type": "json_schema"}), "json_schema is required"),
    ("json_schema name too long", body(response_format={"type": "json_schema", "json_schema": {
        "name": "n" * 65, "schema": {}}}), "response_format.json_schema.name must be at most 64 characters"),
    ("enable_thinking string", body(chat_template_kwargs={"enable_thinking": "yes"}),
     "chat_template_kwargs: enable_thinking must be a boolean"),
    ("thinking_budget 0", body(chat_template_kwargs={"thinking_budget": 0}), "chat_template_kwargs: thinking_budget must be an integer in [1, 2147483647]"),
    ("chat_template_kwargs list", body(chat_template_kwargs=[]), "chat_template_kwargs must be an object"),
    ("stream_options not object", body(stream_options=True), "stream_options must be an object"),
    ("include_usage string", body(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage must be a boolean"),
    ("include_stop_str_in_output int", body(include_stop_str_in_output=1),
     "include_stop_str_in_output must be a boolean"),
    ("skip_special_tokens string", body(skip_special_tokens="false"), "skip_special_tokens must be a boolean"),
    ("use_beam_search int", body(use_beam_search=1), "use_beam_search must be a boolean"),
    ("presence_penalty string", body(presence_penalty="1"), "presence_penalty must be a number"),
    ("seed float", body(seed=1.0), "seed must be an integer"),
    ("top_logprobs negative", body(top_logprobs=-1), "top_logprobs must be in [0, 20]"),
    ("message name number", body(messages=[{"role": "user", "content": "x", "name": 1}]),
     "messages[0].name must be a string"),
    ("prefix string", body(messages=[USER, {"role": "assistant", "content": "a", "prefix": "yes"}]),
     "messages[1].prefix must be a boolean"),
    ("tool_call without id", body(messages=[USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": CALL["function"]}]}]), "messages[1].tool_calls[0].id is required"),
    ("tool parameters not object", body(tools=[{"type": "function", "function": {
        "name": "f", "parameters": "{}"}}]), "tools[0].function.parameters must be an object"),
    ("tool strict string", body(tools=[{"type": "function", "function": {"name": "f", "strict": "no"}}]),
     "tools[0].function.strict must be a boolean"),
    ("tools not list", body(tools={"type": "function"}), "tools must be a list"),
    ("messages over 4 MiB", body(messages=[{"role": "user", "content": "x" * (4 * 1024 * 1024 + 1)}]),
     "messages must be at most 4194304 characters"),
]


@pytest.mark.parametrize("case,data,message", INVALID, ids=[c for c, _, _ in INVALID])
def test_invalid_values_are_422_naming_field_and_rule(case: str, data: dict[str, Any], message: str) -> None:
    with pytest.raises(EdgeError) as caught:
        parse(data)
    error = caught.value
    assert error.status == 422
    assert error.body()["error_type"] == "Input Validation Error"
    assert message in error.message, error.message


def test_number_overflowing_a_double_is_out_of_range() -> None:
    with pytest.raises(EdgeError) as caught:
        parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}')
    assert caught.value.message == "temperature must be in [0, 2]"


@pytest.mark.parametrize(
    "raw,reason",
    [
        (b"{bad", "Expecting property name"),
        (b"", "Expecting value"),
        (b"[1, 2]", "the body must be a JSON object"),
        (b'"text"', "the body must be a JSON object"),
        (b"null", "the body must be a JSON object"),
        (b'{"model": "m", "temperature": NaN}', "NaN is not valid JSON"),
        (b'{"model": "m\xff"}', "not valid UTF-8"),
        (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nesting deeper than 32"),
        (b"[" * 100_000 + b"]" * 100_000, "Failed to parse"),
    ],
)
def test_unparseable_bodies_are_422(raw: bytes, reason: str) -> None:
    with pytest.raises(EdgeError) as caught:
        parse_chat_request(raw)
    assert caught.value.status == 422
    assert caught.value.message.startswith("Failed to parse request context to json")
    assert reason in caught.value.message


LONE = "A\ud800B"  # a valid JSON escape ("A\\ud800B"), but no Unicode string


@pytest.mark.parametrize(
    "data,path",
    [
        (body(model=LONE), "model"),
        (body(messages=[{"role": "user", "content": LONE}]), "messages[0].content"),
        (body(messages=[USER, {"role": "user", "content": [{"type": "text", "text": LONE}]}]),
         "messages[1].content[0].text"),
        (body(messages=[{"role": "user", "content": "hi", "name": LONE}]), "messages[0].name"),
        (body(messages=[{"role": "assistant", "tool_calls": [CALL]},
                        {"role": "tool", "content": "x", "tool_call_id": LONE}]), "messages[1].tool_call_id"),
        (body(messages=[{"role": "assistant", "content": "a", "reasoning_content": "\udfff"}]),
         "messages[0].reasoning_content"),
        (body(stop=LONE), "stop"),
        (body(stop=["ok", LONE]), "stop[1]"),
        (body(tools=[{**TOOL, "function": {**TOOL["function"], "description": LONE}}]),
         "tools[0].function.description"),
        (body(chat_template_kwargs={"deep": [{"x": LONE}]}), "chat_template_kwargs.deep[0].x"),
        (body(unknown_field=LONE), "unknown_field"),  # ignored fields are checked too
        (body(tool_choice=LONE), "tool_choice"),
    ],
)
def test_lone_surrogates_are_422_naming_the_field(data: dict[str, Any], path: str) -> None:
    with pytest.raises(EdgeError) as caught:
        parse(data)
    assert caught.value.status == 422
    assert caught.value.message == f"{path} is not valid Unicode (a lone surrogate)"
    caught.value.response()  # the message itself renders
    # A surrogate pair is one character: the decoder joins "\ud83d\ude00" into U+1F600.
    paired = parse_chat_request(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert paired.messages[0].content == "\U0001F600"


@pytest.mark.parametrize(
    "data,where",
    [
        ({**BASE, LONE: 1}, "the body"),
        (body(chat_template_kwargs={"ok": {"\ud800": True}}), "chat_template_kwargs.ok"),
    ],
)
def test_keys_that_are_not_unicode_are_422(data: dict[str, Any], where: str) -> None:
    with pytest.raises(EdgeError) as caught:
        parse(data)
    assert caught.value.message == f"{where} has a key that is not valid Unicode (a lone surrogate)"


@pytest.mark.parametrize(
    "raw,message",
    [
        (b'{"model": "m", "model": "m", "messages": [{"role": "user", "content": "hi"}]}',
         'duplicate key "model" in the body'),
        (b'{"model": "m", "messages": [{"role": "user", "content": "a", "content": "b"}]}',
         'duplicate key "content" in messages[0]'),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}],'
         b' "chat_template_kwargs": {"x": [{"y": 1, "y": 1}]}}',
         'duplicate key "y" in chat_template_kwargs.x[0]'),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "junk": {"a": 1, "a": 2}}',
         'duplicate key "a" in junk'),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "' + b"k" * 100 + b'": 1, "'
         + b"k" * 100 + b'": 2}', 'duplicate key "' + "k" * 64 + '..." in the body'),
    ],
)
def test_duplicate_keys_are_422_naming_the_key(raw: bytes, message: str) -> None:
    with pytest.raises(EdgeError) as caught:
        parse_chat_request(raw)
    assert (caught.value.status, caught.value.message) == (422, message)


@pytest.mark.parametrize(
    "data,path",
    [
        (body(chat_template_kwargs={"x": 10**400}), "chat_template_kwargs.x"),
        (body(tools=[{**TOOL, "function": {**TOOL["function"], "parameters": {"maximum": -(10**400)}}}]),
         "tools[0].function.parameters.maximum"),
        (body(max_tokens=10**400), "max_tokens"),
    ],
)
def test_integers_past_a_double_are_422(data: dict[str, Any], path: str) -> None:
    # Free-form objects become protobuf Structs, whose numbers are doubles: this was a 500 OverflowError.
    with pytest.raises(EdgeError) as caught:
        parse(data)
    assert (caught.value.status, caught.value.message) == (422, f"{path} is out of range: a number must fit a double")
    assert parse(body(chat_template_kwargs={"x": 2**64})).chat_template_kwargs == {"x": 2**64}
