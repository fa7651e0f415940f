"""A bounded fuzz run against the real chain: request bodies built from the
fields of the pydantic request models (protocol.py), with valid and invalid
values, arbitrary Unicode (lone surrogates included), wrong types and nested
junk. Whatever the body, the answer is never a 5xx, never a failed stream,
never a hang, and the chain stays healthy.

Deterministic (derandomize=True, no example database) and budgeted: a fixed
number of examples, every one of them sent (each test counts what it sent),
max_tokens at most 4, n and best_of at most 2.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from services.common.chat_protocol import ChatCompletionRequest, ContentPart, Message
from services.http_edge.schemas import ChatCompletion, ChatCompletionChunk, ErrorBody
from tests.e2e.conftest import MODEL

TIMEOUT = httpx.Timeout(60.0)  # a request slower than this counts as a hang
MAX_TOKENS = 4
FUZZ = settings(
    derandomize=True, database=None, deadline=None, max_examples=150,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing body is reported as drawn
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- strategies -------------------------------------------------------------------------------

any_char = st.characters(codec=None, categories=None)  # every code point, surrogates allowed but rare
lone = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # a surrogate on its own: no Unicode text
odd_char = st.sampled_from(["\x00", "\u2028", "\ufeff", "\U0001F600", "é", "<", '"', "\\"])
text = (st.text(any_char, max_size=12) | st.text(odd_char, min_size=1, max_size=4)
        | st.tuples(st.text(any_char, max_size=4), lone, st.text(any_char, max_size=4)).map("".join))
huge = st.sampled_from([2**63, 2**64, 10**400, -(10**400)])  # past int64, past a double
scalar = st.none() | st.booleans() | st.integers() | huge | st.floats() | text
junk = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=6)
name = st.sampled_from(["get_weather", "ping", "x"]) | text


def field_names(model: type) -> list[str]:
    """The JSON names of a model's fields (aliases included): a field added to the
    models gets fuzzed with junk until it has a strategy here."""
    names = []
    for field_name, info in model.model_fields.items():
        names.append(info.alias or field_name)
        choices = getattr(info.validation_alias, "choices", None) or ()
        names.extend(c for c in choices if isinstance(c, str) and c not in names)
    return names


def fields_of(model: type, values: dict[str, st.SearchStrategy[Any]], junky: bool,
              required: dict[str, st.SearchStrategy[Any]] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with a few of `model`'s fields: plausible values (in range or not),
    and with `junky` also any JSON at all in their place."""
    required = required or {}
    pick = {n: (values.get(n, junk) | junk) if junky else values.get(n, junk)
            for n in field_names(model) if n not in required}
    chosen = st.lists(st.sampled_from(sorted(pick)), max_size=4, unique=True)
    return chosen.flatmap(lambda keys: st.fixed_dictionaries({**required, **{k: pick[k] for k in keys}}))


def either(model: type, values: dict[str, st.SearchStrategy[Any]],
           required: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    return fields_of(model, values, False, required) | fields_of(model, values, True, required)


content_part = either(ContentPart, {"text": text, "image_url": text, "video_url": text, "audio_url": text},
                      {"type": st.sampled_from(["text", "image_url", "video_url", "audio_url"])})
function_call = st.fixed_dictionaries({"name": name, "arguments": text | st.just("{}")})
tool_call = st.fixed_dictionaries({"id": text, "type": st.just("function"), "function": function_call})
message = either(Message, {
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": text | st.lists(content_part, max_size=2),
    "name": text,
    "tool_calls": st.lists(tool_call | junk, max_size=2),
    "tool_call_id": text,
    "prefix": st.booleans(),
    "reasoning_content": text,
    "reasoning": text,
}, {"role": st.sampled_from(["system", "user", "assistant", "tool"])})
tool = st.fixed_dictionaries({"type": st.just("function") | junk, "function": st.fixed_dictionaries(
    {"name": name}, optional={"description": text, "parameters": junk | st.just({"type": "object"}),
                              "strict": st.booleans()})})
small_int = st.integers(min_value=-2, max_value=MAX_TOKENS)
REQUEST_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": text}) | message,
                         min_size=1, max_size=3),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 3),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(0, 1.5),
    "top_k": st.integers(-2, 100),
    "seed": st.integers(-1, 2**64),
    "stop": text | st.lists(text, max_size=3),
    "stop_token_ids": st.lists(st.integers(-5, 2**40), max_size=3),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "ignore_eos": st.booleans(),
    "max_tokens": small_int,
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": name})}),
    "chat_template_kwargs": st.dictionaries(text, junk, max_size=2)
    | st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(), "thinking_budget": small_int}),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                             optional={"json_schema": st.fixed_dictionaries(
                                                 {"name": text, "schema": junk | st.just({"type": "object"})})}),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "n": st.integers(0, 3),
    "best_of": st.integers(0, 3),
    "use_beam_search": st.booleans(),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "continue_final_message": st.booleans(),
}


def mostly(value: Any, otherwise: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`value` about three times in four, else a draw of `otherwise`."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda keep: st.just(value) if keep else otherwise)


# Mostly the served model and a plain message, so that the other fields decide.
body_strategy = either(ChatCompletionRequest, REQUEST_VALUES, {
    "model": mostly(MODEL, text),
    "messages": mostly([{"role": "user", "content": "Hi"}], REQUEST_VALUES["messages"]),
})


def cheap(body: dict[str, Any]) -> dict[str, Any]:
    """Keep generation small whatever was drawn: an integer max_tokens, n or
    best_of that would pass validation is clamped; no max_tokens means 4."""
    for key, cap in (("max_tokens", MAX_TOKENS), ("n", 2), ("best_of", 2)):
        if type(body.get(key)) is int and body[key] > cap:
            body[key] = cap
    if body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    return body


def run_counted(fuzz: Callable[[list[bytes]], None], budget: settings) -> None:
    """Run the property `fuzz(sent)`, which appends each body it sends to `sent`:
    every example hypothesis draws must have been sent, not just drawn."""
    sent: list[bytes] = []
    fuzz(sent)
    assert len(sent) >= budget.max_examples, f"{len(sent)} bodies sent, {budget.max_examples} drawn"


# -- the checks -------------------------------------------------------------------------------


def post_and_check(client: httpx.Client, raw: bytes, stream: bool) -> int:
    """POST the body; fail on a 5xx, a malformed reply, a failed stream or a timeout."""
    with client.stream("POST", "/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"}) as reply:
        payload = reply.read()
    status = reply.status_code
    assert status < 500, (status, payload[:500], raw[:2000])
    if status != 200:
        ErrorBody.model_validate_json(payload)
    elif reply.headers["content-type"] == "text/event-stream":
        assert stream and payload.endswith(b"data: [DONE]\n\n"), (payload[-300:], raw[:2000])
        for event in payload.split(b"\n\n")[:-2]:
            chunk = json.loads(event.removeprefix(b"data: "))
            assert "error" not in chunk, (chunk, raw[:2000])  # a stream that failed after it started
            ChatCompletionChunk.model_validate(chunk)
    else:
        ChatCompletion.model_validate_json(payload)
    return status


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=TIMEOUT) as http:
        # The Unicode property starts from a request the chain serves.
        assert post_and_check(http, json.dumps(BASE).encode(), stream=False) == 200
        yield http
        assert http.get("/health").status_code == 200  # still serving after the run


def test_fuzzed_bodies_never_get_a_5xx(client):
    @FUZZ
    @given(body=body_strategy, stream=st.sampled_from([True, False]), duplicate=mostly(False, st.just(True)))
    @example(body={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "chat_template_kwargs": {"x": 10**400}}, stream=False, duplicate=False)
    def fuzz(sent, body, stream, duplicate):
        body = cheap(body)
        body.setdefault("stream", stream)
        raw = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as a valid \\udXXX escape
        if duplicate:  # a repeated key, which a dict cannot hold
            raw = b'{"max_tokens": 1, ' + raw[1:]
        post_and_check(client, raw, stream=body.get("stream") is True)
        sent.append(raw)

    run_counted(fuzz, FUZZ)


# Every string field of one valid request; `("key", path)` puts the text in a key there.
BASE = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Fuzz."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "content": "pong", "tool_call_id": "call_1"},
        {"role": "user", "content": "Again?"},
    ],
    "stop": ["zz", "yy"],
    "tools": [{"type": "function", "function": {
        "name": "ping", "description": "Check the line.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_schema", "json_schema": {"name": "out", "description": "Any object.",
                                                               "schema": {"type": "object"}}},
    "chat_template_kwargs": {"enable_thinking": False, "note": "n"},
    "max_tokens": 1,
    "temperature": 0,
}
STRING_PATHS: list[tuple[Any, ...]] = [
    ("model",), ("messages", 0, "content"), ("messages", 1, "content", 0, "text"), ("messages", 1, "name"),
    ("messages", 2, "content"), ("messages", 2, "reasoning_content"), ("messages", 2, "tool_calls", 0, "id"),
    ("messages", 2, "tool_calls", 0, "function", "name"), ("messages", 2, "tool_calls", 0, "function", "arguments"),
    ("messages", 3, "content"), ("messages", 3, "tool_call_id"), ("messages", 4, "content"), ("messages", 4, "role"),
    ("stop", 0), ("stop",), ("tools", 0, "function", "name"), ("tools", 0, "function", "description"),
    ("tools", 0, "function", "parameters", "properties", "x", "type"), ("tool_choice",),
    ("response_format", "json_schema", "name"), ("response_format", "json_schema", "description"),
    ("chat_template_kwargs", "note"), ("key", "chat_template_kwargs"), ("key", "tools", 0, "function", "parameters"),
    ("key", "messages", 4), ("key",),
]


def put(body: dict[str, Any], path: tuple[Any, ...], value: str) -> None:
    """Set the string at `path`, or with ("key", *path) add `value` as a key of the object there."""
    as_key = path[0] == "key"
    steps = path[1:] if as_key else path[:-1]
    node = body
    for step in steps:
        node = node[step]
    if as_key:
        node[value] = "v"
    else:
        node[path[-1]] = value


UNICODE_FUZZ = settings(FUZZ, max_examples=50)


def test_any_unicode_in_any_string_field_is_never_a_5xx(client):
    @UNICODE_FUZZ
    @given(edits=st.lists(st.tuples(st.sampled_from(STRING_PATHS), text), min_size=1, max_size=3),
           stream=st.booleans())
    def fuzz(sent, edits, stream):
        body = copy.deepcopy(BASE)
        body["stream"] = stream
        for path, value in edits:
            put(body, path, value)
        raw = json.dumps(body).encode()
        post_and_check(client, raw, stream)
        sent.append(raw)

    run_counted(fuzz, UNICODE_FUZZ)

