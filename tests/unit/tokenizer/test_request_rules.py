"""The tokenizer checks every ChatRequest with the edge's own rules: a request
the edge converts comes back as the same JSON, and a field out of range is
refused over gRPC with the words the edge's 422 uses."""
from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from services.common.chat_protocol import ChatCompletionRequest
from services.common.errors import ServiceError
from services.common.validation import describe_validation
from services.http_edge.convert import to_chat_request
from services.tokenizer.request_rules import check_chat_request, check_messages, request_json
from stormserve.chat.v1 import chat_pb2

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}}}}
VALID_BODIES = [
    {"model": "m", "messages": USER},
    {"model": "m", "messages": USER, "stream": True, "temperature": 0.5, "top_p": 0.25, "top_k": -1,
     "seed": 2**64 - 1, "max_tokens": 7, "presence_penalty": -2.0, "frequency_penalty": 2.0,
     "repetition_penalty": 1.5, "stop": ["a", "bb"], "stop_token_ids": [2, 3], "ignore_eos": True,
     "include_stop_str_in_output": False, "skip_special_tokens": False, "logprobs": True, "top_logprobs": 20,
     "stream_options": {"include_usage": False}, "n": 2, "best_of": 2},
    {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": "https://x.test/a.png",
                                                                         "detail": "low"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is", "prefix": True}],
     "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
     "chat_template_kwargs": {"enable_thinking": True, "thinking_budget": 64}},
    {"model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": "required"},
    {"model": "m", "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}},
    {"model": "m", "messages": USER, "response_format": {"type": "json_object"}, "use_beam_search": True,
     "n": 2, "temperature": 0},
]


def proto(body: dict[str, Any]) -> chat_pb2.ChatRequest:
    return to_chat_request(ChatCompletionRequest.model_validate(body), request_id="r", arrival_time_us=1)


@pytest.mark.parametrize("body", VALID_BODIES)
def test_a_converted_request_comes_back_whole(body) -> None:
    request = proto(body)
    check_chat_request(request)
    assert proto(request_json(request)) == request


def grpc_refusal(request: chat_pb2.ChatRequest) -> str:
    with pytest.raises(ServiceError) as raised:
        check_chat_request(request)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return raised.value.message


def rest_refusal(body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate(body)
    return describe_validation(raised.value.errors(include_url=False))


# (what a gRPC caller sets, the same as a JSON body, the field the refusal names)
OUT_OF_RANGE = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"best_of": 129, "temperature": 1.0}, "best_of"),
    ({"n": 2}, "temperature"),
    ({"stop": ["x"] * 10_000}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content[0]"),
    ({"model": "a/b"}, "model"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"chat_template_kwargs": {"thinking_budget": 0}}, "thinking_budget"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "enable_thinking"),
]


def _set(request: chat_pb2.ChatRequest, change: dict[str, Any]) -> None:
    """`change` applied to a proto the way a gRPC caller would write it."""
    for name, value in change.items():
        if name == "messages":
            del request.messages[:]
            for message in value:
                item = request.messages.add(role=message["role"])
                content = message.get("content")
                if isinstance(content, str):
                    item.content = content
                for part in content if isinstance(content, list) else ():
                    item.content_parts.add(type=part["type"], text=part["text"])
        elif name == "tools":
            request.tools.add(type="function").function.name = value[0]["function"]["name"]
        elif name == "chat_template_kwargs":
            request.chat_template_kwargs.update(value)
        elif name == "stop":
            request.stop.extend(value)
        else:
            setattr(request, name, value)


@pytest.mark.parametrize(("change", "field"), OUT_OF_RANGE, ids=[repr(c)[:40] for c, _ in OUT_OF_RANGE])
def test_grpc_refuses_what_rest_refuses_with_the_same_words(change, field) -> None:
    request = chat_pb2.ChatRequest(model="m", messages=[chat_pb2.ChatMessage(role="user", content="hi")])
    _set(request, change)
    message = grpc_refusal(request)
    assert field in message
    assert message == rest_refusal({"model": "m", "messages": USER, **change})


def test_grpc_only_shapes_are_refused_too() -> None:
    nan = chat_pb2.ChatRequest(model="m", messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                               temperature=math.nan)
    assert grpc_refusal(nan).startswith("temperature")
    no_model = chat_pb2.ChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="hi")])
    assert grpc_refusal(no_model) == "model is required"
    both = chat_pb2.ChatRequest(model="m", messages=[chat_pb2.ChatMessage(
        role="user", content="hi", content_parts=[chat_pb2.ContentPart(type="text", text="hi")])])
    assert "content and content_parts" in grpc_refusal(both)


def test_apply_chat_template_messages_follow_the_same_rules() -> None:
    check_messages([chat_pb2.ChatMessage(role="user", content="hi")])
    with pytest.raises(ServiceError) as raised:
        check_messages([chat_pb2.ChatMessage(role="user", content="hi"), chat_pb2.ChatMessage(role="wizard")])
    assert raised.value.message.startswith("messages[1].role must be one of")
