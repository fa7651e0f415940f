"""The output path with tools and reasoning: scheduler tokens -> ChoiceOutput
-> the JSON a client sees (stream chunks and the aggregated reply)."""
from __future__ import annotations

import json

import pytest

from services.http_edge.render import CompletionBuilder, ReplyContext, chunk_json
from services.tokenizer.formats import OutputOptions
from services.tokenizer.output import ChoiceOutput
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.tokenizer.tool_fixtures import (
    DEEPSEEK_MARKERS,
    deepseek_like_tokenizer,
    smol_tokenizer,
    token_responses,
)

CTX = ReplyContext(request_id="chatcmpl-1", model="m", created=1)
HERMES = (
    'Checking.<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_id": "12345"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)
THINK = "<think>The user wants a date.</think>"
LENGTH = scheduler_pb2.FINISH_REASON_LENGTH
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


def run(tokenizer, text: str, stream: bool, options: OutputOptions, finish=scheduler_pb2.FINISH_REASON_STOP,
        tokenizer_ids: list[int] | None = None, **fields):
    request = chat_pb2.ChatRequest(model="m", stream=stream, **fields)
    output = ChoiceOutput(tokenizer, request, "chatcmpl-1", 1, prompt_tokens=10, options=options)
    ids = tokenizer_ids or tokenizer.encode(text, add_special_tokens=False)
    chunks = [c for r in token_responses(ids, finish, eos=EOS if finish != LENGTH else None)
              if (c := output.on_response(r)) is not None]
    assert output.is_finished
    return chunks


def reply(chunks) -> dict:
    builder = CompletionBuilder(CTX)
    for chunk in chunks:
        builder.add(chunk)
    return builder.result()


def stream_json(chunks) -> list[dict]:
    return [chunk_json(c, CTX)["choices"][0] for c in chunks]


def fold_stream_calls(choices: list[dict]) -> list[dict]:
    """What an OpenAI client does with the deltas, checking their shape."""
    calls: dict[int, dict] = {}
    for choice in choices:
        for d in choice["delta"].get("tool_calls", []):
            if d["index"] not in calls:
                assert d["type"] == "function" and d["id"].startswith("call_") and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_non_stream_message_has_parsed_calls(tokenizer):
    message_reply = reply(run(tokenizer, HERMES, stream=False, options=OutputOptions("hermes")))
    choice = message_reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    assert "reasoning_content" not in message
    calls = message["tool_calls"]
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("function", "get_delivery_date", '{"order_id": "12345"}'), ("function", "ping", "{}")]
    assert len({c["id"] for c in calls}) == 2 and all("index" not in c for c in calls)


def test_stream_deltas_have_the_openai_shape(tokenizer):
    choices = stream_json(run(tokenizer, HERMES, stream=True, options=OutputOptions("hermes")))
    assert "".join(c["delta"]["content"] for c in choices) == "Checking."
    calls = fold_stream_calls(choices)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_delivery_date", {"order_id": "12345"}), ("ping", {})]
    assert calls[1]["arguments"] == "{}"
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_without_tools_the_markup_stays_content(tokenizer):
    choice = reply(run(tokenizer, HERMES, stream=False, options=OutputOptions()))["choices"][0]
    assert choice["message"]["content"] == HERMES and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"


def test_invalid_block_non_stream_is_all_content(tokenizer):
    text = 'Sure <tool_call>{"name": "x", "arguments": {bad}}</tool_call>'
    choice = reply(run(tokenizer, text, stream=False, options=OutputOptions("hermes")))["choices"][0]
    assert (choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]) == (
        text, [], "stop")


def test_length_with_a_call_non_stream_says_tool_calls_and_stream_length(tokenizer):
    # Reference §2.4: non-stream answers tool_calls, stream keeps length.
    non_stream = reply(run(tokenizer, HERMES, stream=False, options=OutputOptions("hermes"), finish=LENGTH))
    assert non_stream["choices"][0]["finish_reason"] == "tool_calls"
    stream = stream_json(run(tokenizer, HERMES, stream=True, options=OutputOptions("hermes"), finish=LENGTH))
    assert stream[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_calls(tokenizer, stream):
    chunks = run(tokenizer, THINK + HERMES, stream=stream, options=OutputOptions("hermes", reasoning=True))
    ids = tokenizer.encode(THINK + HERMES, add_special_tokens=False)
    # Tokens emitted while the think block was open: all before the one completing `</think>`.
    closing = next(k for k in range(len(ids)) if "</think>" in tokenizer.decode(ids[:k + 1]))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == closing
    message = reply(chunks)
    assert message["usage"]["completion_tokens_details"] == {"reasoning_tokens": closing}
    msg = message["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "The user wants a date."
    assert msg["content"] == "Checking." and len(msg["tool_calls"]) == 2
    assert message["choices"][0]["finish_reason"] == "tool_calls"
    if stream:
        deltas = [c["delta"] for c in stream_json(chunks)]
        assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning_content" in d)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants a date."


@pytest.mark.parametrize("stream", [False, True])
def test_truncated_think_block_stays_reasoning(tokenizer, stream):
    # R1 style: the prompt opened <think>, the output never closes it.
    chunks = run(tokenizer, "Still thinking about it", stream=stream, options=OutputOptions(reasoning=True),
                 finish=LENGTH)
    message = reply(chunks)
    msg = message["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Still thinking about it", "")
    usage = message["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]


def test_reasoning_parser_that_found_nothing_still_reports_empty_reasoning(tokenizer):
    msg = reply(run(tokenizer, "<think></think>Direct.", stream=False,
                    options=OutputOptions(reasoning=True)))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("", "Direct.")


def test_deepseek_special_markers_reach_the_parser_and_other_specials_do_not_leak():
    tokenizer = deepseek_like_tokenizer()
    text = ("Let me<|im_start|> look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_delivery_date\n"
            '```json\n{"order_id": "12345"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert {tokenizer.convert_tokens_to_ids(m) for m in ("<｜tool▁calls▁begin｜>", "<|im_start|>")} <= set(ids)
    markers = frozenset(tokenizer.convert_tokens_to_ids(DEEPSEEK_MARKERS))
    options = OutputOptions("deepseek_v3", keep_special_ids=markers)
    for stream in (False, True):
        chunks = run(tokenizer, text, stream=stream, options=options, tokenizer_ids=ids)
        msg = reply(chunks)["choices"][0]["message"]
        assert msg["content"] == "Let me look."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
            ("get_delivery_date", '{"order_id": "12345"}')]
    # Without a tool parser special tokens are skipped as before: markers vanish.
    plain = reply(run(tokenizer, text, stream=False, options=OutputOptions(), tokenizer_ids=ids))
    assert "<｜" not in plain["choices"][0]["message"]["content"]
    # A caller that asked for special tokens sees every one, <|im_start|> too.
    raw = reply(run(tokenizer, text, stream=False, options=options, tokenizer_ids=ids, skip_special_tokens=False))
    assert raw["choices"][0]["message"]["content"] == "Let me<|im_start|> look."
