"""ChoiceOutput with the real tokenizer: where usage goes (stream_options) and
the cumulative fullTextEnabled stream."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.common.model_files import default_model_path, resolve_model
from services.tokenizer.output import ChoiceOutput, UsagePlacement, usage_placement
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2

TEXT = "Hello! How can I assist you today?"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


def request(**fields) -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(model="m", **fields)


def responses(tokenizer, text: str) -> list[scheduler_pb2.GenerateResponse]:
    """One scheduler message per token; the last one ends the sequence by length."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = [scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(
        token_id=i, batch_size=1, queue_wait_us=10 + n, latency_ms=5.0)]) for n, i in enumerate(ids)]
    out[-1].finish_reason = scheduler_pb2.FINISH_REASON_LENGTH
    return out


def run(tokenizer, req: chat_pb2.ChatRequest, full_text_enabled: bool = False):
    output = ChoiceOutput(tokenizer, req, "chatcmpl-1", 1730184192, prompt_tokens=31,
                          full_text_enabled=full_text_enabled)
    chunks = []
    for response in responses(tokenizer, TEXT):
        if (chunk := output.on_response(response)) is not None:
            chunks.append(chunk)
        if output.is_finished:  # as ChatServicer does: nothing is read after the end
            break
    assert output.is_finished
    return output, chunks


@pytest.mark.parametrize("fields,placement", [
    ({"stream": True}, UsagePlacement.FINAL_CHUNK),
    ({"stream": True, "stream_options": {"include_usage": True}}, UsagePlacement.SEPARATE_CHUNK),
    ({"stream": True, "stream_options": {"include_usage": False}}, UsagePlacement.NONE),
    # An aggregating (non-stream) caller always gets usage on the final chunk.
    ({"stream_options": {"include_usage": True}}, UsagePlacement.FINAL_CHUNK),
    ({"stream_options": {"include_usage": False}}, UsagePlacement.FINAL_CHUNK),
])
def test_usage_placement(fields, placement):
    assert usage_placement(request(**fields)) == placement


def test_usage_rides_on_the_final_chunk_without_stream_options(tokenizer):
    output, chunks = run(tokenizer, request(stream=True))
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.total_tokens) == (31, 31 + usage.completion_tokens)
    assert len(usage.batch_size) == len(usage.queue_wait_time) == usage.completion_tokens
    assert output.usage_chunk() is None


def test_include_usage_true_moves_usage_to_one_chunk_without_choices(tokenizer):
    output, chunks = run(tokenizer, request(stream=True, stream_options={"include_usage": True}))
    assert not any(c.HasField("usage") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == chat_pb2.FINISH_REASON_LENGTH
    extra = output.usage_chunk()
    assert extra is not None and len(extra.choices) == 0
    assert (extra.id, extra.created, extra.model) == ("chatcmpl-1", 1730184192, "m")
    assert extra.usage.completion_tokens == len(tokenizer.encode(TEXT, add_special_tokens=False))
    assert list(extra.usage.queue_wait_time) == list(range(10, 10 + extra.usage.completion_tokens))


def test_include_usage_false_sends_no_usage(tokenizer):
    output, chunks = run(tokenizer, request(stream=True, stream_options={"include_usage": False}))
    assert not any(c.HasField("usage") for c in chunks)
    assert output.usage_chunk() is None


def test_full_text_enabled_streams_the_text_so_far(tokenizer):
    _, chunks = run(tokenizer, request(stream=True), full_text_enabled=True)
    contents = [c.choices[0].delta.content for c in chunks]
    assert contents[-1] == TEXT
    for shorter, longer in zip(contents, contents[1:]):
        assert longer.startswith(shorter) and len(longer) >= len(shorter)
    assert len(set(contents[:-1])) == len(contents) - 1  # every non-final chunk adds text
    assert [c.HasField("full_text") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].full_text == TEXT and chunks[-1].HasField("usage")


def test_full_text_enabled_leaves_an_aggregating_caller_with_deltas(tokenizer):
    _, chunks = run(tokenizer, request(stream=False), full_text_enabled=True)
    assert "".join(c.choices[0].delta.content for c in chunks) == TEXT
    assert not any(c.HasField("full_text") for c in chunks)


def test_full_text_enabled_with_a_stop_string_never_shows_it(tokenizer):
    _, chunks = run(tokenizer, request(stream=True, stop=["assist"]), full_text_enabled=True)
    assert chunks[-1].full_text == "Hello! How can I "
    assert all("assist" not in c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == chat_pb2.FINISH_REASON_STOP
