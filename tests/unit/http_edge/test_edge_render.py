"""ChatChunk -> documented JSON (stream chunks and the aggregated reply), and
the validated request -> ChatRequest."""
from __future__ import annotations

import json
import math

from google.protobuf import json_format
from stormserve.chat.v1 import chat_pb2

from services.http_edge.convert import to_chat_request
from services.http_edge.render import CompletionBuilder, ReplyContext, chunk_json
from services.http_edge.serving import parse_chat_request

CTX = ReplyContext(request_id="chatcmpl-1", model="m", created=1700000000, system_fingerprint="fp_0123456789")


def chunk(content: str = "", index: int = 0, finish: int = 0, **fields) -> chat_pb2.ChatChunk:
    delta = fields.pop("delta", None) or chat_pb2.ChatDelta(role="assistant", content=content)
    choice = chat_pb2.ChunkChoice(index=index, delta=delta, finish_reason=finish)
    if "logprobs" in fields:
        choice.logprobs.CopyFrom(fields.pop("logprobs"))
    return chat_pb2.ChatChunk(id="chatcmpl-1", created=1700000000, model="m", choices=[choice], **fields)


def usage(prompt: int, completion: int, steps: int, reasoning: int = 0, cached: int = 0) -> chat_pb2.Usage:
    return chat_pb2.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=chat_pb2.PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=chat_pb2.CompletionTokensDetails(reasoning_tokens=reasoning),
        batch_size=[1] * steps,
        queue_wait_time=[100 + i for i in range(steps)],
    )


def test_stream_chunk_matches_the_documented_example_shape() -> None:
    rendered = chunk_json(chunk("Hello"), CTX)
    assert json.dumps(rendered, separators=(",", ":")) == (
        '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'
        '"system_fingerprint":"fp_0123456789",'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":"Hello"},"finish_reason":null}]}'
    )


def test_final_stream_chunk_has_usage_full_text_and_finish_reason() -> None:
    final = chunk("", finish=chat_pb2.FINISH_REASON_LENGTH, usage=usage(31, 10, 10, cached=4), full_text="Hi!")
    rendered = chunk_json(final, CTX)
    assert list(rendered) == ["id", "object", "created", "model", "system_fingerprint", "full_text", "usage",
                             "choices"]
    assert rendered["full_text"] == "Hi!"
    assert rendered["usage"] == {
        "prompt_tokens": 31,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens": 10,
        "total_tokens": 41,
        "batch_size": [1] * 10,
        "queue_wait_time": list(range(100, 110)),
    }
    assert rendered["choices"][0]["finish_reason"] == "length"
    assert "logprobs" not in rendered["choices"][0]  # not requested


def test_reasoning_tokens_appear_only_when_positive() -> None:
    assert "completion_tokens_details" not in chunk_json(chunk(usage=usage(1, 2, 2)), CTX)["usage"]
    details = chunk_json(chunk(usage=usage(1, 5, 5, reasoning=3)), CTX)["usage"]
    assert list(details) == [
        "prompt_tokens", "prompt_tokens_details", "completion_tokens",
        "completion_tokens_details", "total_tokens", "batch_size", "queue_wait_time",
    ]
    assert details["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_delta_carries_reasoning_under_both_names_and_tool_call_deltas() -> None:
    delta = chat_pb2.ChatDelta(role="assistant", content="", reasoning_content="hmm")
    assert chunk_json(chunk(delta=delta), CTX)["choices"][0]["delta"] == {
        "role": "assistant", "content": "", "reasoning_content": "hmm", "reasoning": "hmm",
    }
    first = chat_pb2.ToolCall(index=0, id="call_ab12CD34", type="function",
                              function=chat_pb2.FunctionCall(name="get_date"))
    more = chat_pb2.ToolCall(index=0, function=chat_pb2.FunctionCall(arguments='{"id": 1}'))
    rendered = chunk_json(chunk(delta=chat_pb2.ChatDelta(role="assistant", tool_calls=[first, more])), CTX)
    assert rendered["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_ab12CD34", "type": "function", "function": {"name": "get_date", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"id": 1}'}},
    ]


def test_logprobs_only_when_requested_and_never_infinite() -> None:
    logprobs = chat_pb2.ChoiceLogprobs(content=[chat_pb2.TokenLogprob(
        token="Hi", logprob=-0.5, bytes=b"Hi",
        top_logprobs=[chat_pb2.TopLogprob(token="Yo", logprob=-math.inf, bytes=b"Yo")])])
    wanted = ReplyContext("chatcmpl-1", "m", 1, include_logprobs=True)
    assert chunk_json(chunk("Hi", logprobs=logprobs), wanted)["choices"][0]["logprobs"] == {"content": [{
        "token": "Hi", "logprob": -0.5, "bytes": [72, 105],
        "top_logprobs": [{"token": "Yo", "logprob": -9999.0, "bytes": [89, 111]}],
    }]}
    assert chunk_json(chunk("Hi"), wanted)["choices"][0]["logprobs"] is None
    assert "logprobs" not in chunk_json(chunk("Hi", logprobs=logprobs), CTX)["choices"][0]


def test_empty_chunk_fields_fall_back_to_the_request() -> None:
    bare = chat_pb2.ChatChunk(choices=[chat_pb2.ChunkChoice(delta=chat_pb2.ChatDelta(content="x"))])
    rendered = chunk_json(bare, CTX)
    assert (rendered["id"], rendered["created"], rendered["model"]) == ("chatcmpl-1", 1700000000, "m")
    assert rendered["choices"][0]["delta"]["role"] == "assistant"


def test_aggregate_single_choice() -> None:
    builder = CompletionBuilder(CTX)
    builder.add(chunk("Hello"))
    builder.add(chunk(", world"))
    builder.add(chunk("", finish=chat_pb2.FINISH_REASON_STOP, usage=usage(9, 3, 3),
                      prefill_time=199.6, decode_time_arr=[56.4, 27.5]))
    assert builder.result() == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": "fp_0123456789",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, world", "tool_calls": []},
            "logprobs": None,
            "finish_reason": "stop",
        }],
        "usage": {
            "prompt_tokens": 9,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens": 3,
            "total_tokens": 12,
            "batch_size": [1, 1, 1],
            "queue_wait_time": [100, 101, 102],
        },
        "prefill_time": 200,
        "decode_time_arr": [56, 28],
    }


def test_aggregate_interleaved_choices_sums_tokens_and_keeps_longest_arrays() -> None:
    builder = CompletionBuilder(CTX)
    builder.add(chunk("a", index=1))
    builder.add(chunk("b", index=0))
    builder.add(chunk("c", index=1, finish=chat_pb2.FINISH_REASON_STOP, usage=usage(5, 2, 2),
                      prefill_time=10, decode_time_arr=[3]))
    builder.add(chunk("d", index=0))
    builder.add(chunk("e", index=0, finish=chat_pb2.FINISH_REASON_LENGTH, usage=usage(5, 3, 3, reasoning=1),
                      prefill_time=10, decode_time_arr=[3, 4]))
    result = builder.result()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in result["choices"]] == [
        (0, "bde", "length"), (1, "ac", "stop"),
    ]
    assert result["usage"]["completion_tokens"] == 5
    assert result["usage"]["total_tokens"] == 10
    assert result["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
    assert result["usage"]["batch_size"] == [1, 1, 1]
    assert result["decode_time_arr"] == [3, 4]


def test_aggregate_merges_tool_calls_reasoning_and_logprobs() -> None:
    wanted = ReplyContext("chatcmpl-1", "m", 1, include_logprobs=True)
    builder = CompletionBuilder(wanted)
    lp = chat_pb2.ChoiceLogprobs(content=[chat_pb2.TokenLogprob(token="t", logprob=-1.0, bytes=b"t")])
    builder.add(chunk(delta=chat_pb2.ChatDelta(reasoning_content="think "), logprobs=lp))
    builder.add(chunk(delta=chat_pb2.ChatDelta(reasoning_content="more", content="Let me check."), logprobs=lp))
    builder.add(chunk(delta=chat_pb2.ChatDelta(tool_calls=[chat_pb2.ToolCall(
        index=0, id="call_1", type="function", function=chat_pb2.FunctionCall(name="f", arguments='{"a"'))])))
    builder.add(chunk(delta=chat_pb2.ChatDelta(tool_calls=[
        chat_pb2.ToolCall(index=0, function=chat_pb2.FunctionCall(arguments=": 1}")),
        chat_pb2.ToolCall(index=1, id="call_2", type="function", function=chat_pb2.FunctionCall(name="g")),
    ]), finish=chat_pb2.FINISH_REASON_TOOL_CALLS))
    choice = builder.result()["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "think more",
        "reasoning": "think more",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}},
        ],
    }
    assert choice["finish_reason"] == "tool_calls"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["t", "t"]


def test_aggregate_keeps_empty_reasoning_when_the_parser_ran() -> None:
    # The tokenizer marks a reply whose reasoning parser ran with `""` on the
    # final chunk; a reply without the parser has no reasoning keys at all.
    builder = CompletionBuilder(CTX)
    builder.add(chunk("Direct."))
    builder.add(chunk(delta=chat_pb2.ChatDelta(reasoning_content=""), finish=chat_pb2.FINISH_REASON_STOP))
    message = builder.result()["choices"][0]["message"]
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == ("", "", "Direct.")
    plain = CompletionBuilder(CTX)
    plain.add(chunk("Direct.", finish=chat_pb2.FINISH_REASON_STOP))
    assert "reasoning_content" not in plain.result()["choices"][0]["message"]


def test_aggregate_prefers_full_text_over_cumulative_deltas() -> None:
    builder = CompletionBuilder(CTX)
    for text in ["Hel", "Hello", "Hello!"]:  # fullTextEnabled: cumulative deltas
        builder.add(chunk(text))
    builder.add(chunk("Hello!", finish=chat_pb2.FINISH_REASON_STOP, full_text="Hello!"))
    assert builder.result()["choices"][0]["message"]["content"] == "Hello!"


def test_aggregate_without_timings_or_usage() -> None:
    builder = CompletionBuilder(CTX)
    builder.add(chunk("x"))
    result = builder.result()
    assert result["prefill_time"] is None and result["decode_time_arr"] == []
    assert result["usage"]["completion_tokens"] == 0
    assert result["choices"][0]["finish_reason"] == "stop"


def to_proto(data: dict) -> chat_pb2.ChatRequest:
    return to_chat_request(parse_chat_request(json.dumps(data).encode()), "chatcmpl-x", 1_700_000_000_123_456)


def test_request_to_proto_keeps_absent_fields_unset() -> None:
    request = to_proto({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert json_format.MessageToDict(request, preserving_proto_field_name=True) == {
        "request_id": "chatcmpl-x",
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "arrival_time_us": "1700000000123456",
    }
    for name in ("temperature", "top_k", "seed", "max_tokens", "n", "logprobs", "tool_choice"):
        assert not request.HasField(name), name


def test_request_to_proto_carries_every_field() -> None:
    request = to_proto({
        "model": "m", "stream": True, "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 2**64 - 1,
        "presence_penalty": -2, "frequency_penalty": 1, "repetition_penalty": 1.5, "max_tokens": 7,
        "stop": "END", "stop_token_ids": [2, 2, 13], "include_stop_str_in_output": True,
        "skip_special_tokens": False, "ignore_eos": True, "n": 1, "best_of": 1, "use_beam_search": False,
        "top_logprobs": 3, "chat_template_kwargs": {"enable_thinking": False, "thinking_budget": 8},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "messages": [
            {"role": "system", "content": "s", "name": "boss"},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "/i.png", "detail": "high"}},
                                         {"type": "audio_url", "audio_url": "/a.wav"}]},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "assistant", "content": "The", "prefix": True, "reasoning_content": "r"},
        ],
    })
    assert request.stream and request.temperature == 0 and request.HasField("temperature")
    assert request.top_k == -1 and request.seed == 2**64 - 1 and request.max_tokens == 7
    assert list(request.stop) == ["END"] and list(request.stop_token_ids) == [2, 13]
    assert request.include_stop_str_in_output and not request.skip_special_tokens and request.ignore_eos
    assert request.logprobs and request.top_logprobs == 3  # top_logprobs alone implies logprobs
    assert request.chat_template_kwargs["enable_thinking"] is False
    assert request.chat_template_kwargs["thinking_budget"] == 8
    assert request.response_format.type == chat_pb2.RESPONSE_FORMAT_TYPE_JSON_SCHEMA
    assert request.response_format.json_schema.schema["type"] == "object"
    assert request.stream_options.include_usage
    assert request.tools[0].function.name == "f" and request.tools[0].function.strict
    assert request.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_FUNCTION
    assert request.tool_choice.function_name == "f"
    system, user, call, tool, prefix = request.messages
    assert system.name == "boss" and system.content == "s"
    assert not user.HasField("content")
    assert [p.type for p in user.content_parts] == ["text", "image_url", "audio_url"]
    assert user.content_parts[1].image_url.url == "/i.png" and user.content_parts[1].image_url.detail == "high"
    assert user.content_parts[2].audio_url.url == "/a.wav"
    assert not call.HasField("content") and call.tool_calls[0].function.arguments == "{}"
    assert tool.tool_call_id == "c1"
    assert prefix.prefix and prefix.reasoning_content == "r"


def test_tool_choice_strings_and_explicit_false_logprobs() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert to_proto({**base, "tool_choice": "none"}).tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_NONE
    assert to_proto({**base, "tool_choice": "required"}).tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_REQUIRED
    explicit = to_proto({**base, "logprobs": False})
    assert explicit.HasField("logprobs") and not explicit.logprobs


def test_system_fingerprint_on_every_chunk_and_the_aggregate() -> None:
    usage_only = chat_pb2.ChatChunk(id="chatcmpl-1", created=1700000000, model="m", usage=usage(3, 1, 1))
    streamed = ReplyContext("chatcmpl-1", "m", 1, null_usage=True, system_fingerprint="fp_0123456789")
    for rendered in (chunk_json(chunk("a"), streamed), chunk_json(usage_only, streamed)):
        assert list(rendered)[:5] == ["id", "object", "created", "model", "system_fingerprint"]
        assert rendered["system_fingerprint"] == "fp_0123456789"
    assert chunk_json(usage_only, streamed)["choices"] == []
    builder = CompletionBuilder(streamed)
    builder.add(usage_only)
    assert builder.result()["system_fingerprint"] == "fp_0123456789"
    # One the backend sends wins.
    assert chunk_json(chunk("a", system_fingerprint="fp_backend"), streamed)["system_fingerprint"] == "fp_backend"
