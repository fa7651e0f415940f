"""The edge over real gRPC against the fake ChatService of test_http_edge:
stream_options.include_usage, the fullTextEnabled frame shape, API keys and
the e2e request timeout."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import openai
import pytest
from stormserve.chat.v1 import chat_pb2

from services.common.fingerprint import system_fingerprint

from tests.integration.test_http_edge import (
    BODY,
    backend,
    delta_chunk,
    edge_client,
    error_body,
    hold,
    hold_after_one,
    live_edge,
    run,
    sse_payloads,
)

STREAM = {**BODY, "stream": True}
USAGE = chat_pb2.Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6, batch_size=[1, 1],
                       queue_wait_time=[812, 95])
USAGE_JSON = {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens": 2,
              "total_tokens": 6, "batch_size": [1, 1], "queue_wait_time": [812, 95]}


async def usage_last(request):
    """As the tokenizer answers include_usage true: usage only in a last chunk without choices."""
    yield delta_chunk(request, "Hello")
    yield delta_chunk(request, " there", chat_pb2.FINISH_REASON_STOP)
    yield chat_pb2.ChatChunk(id=request.request_id, created=request.arrival_time_us // 1_000_000,
                             model=request.model, usage=USAGE)


# -- 1. usage in streams --------------------------------------------------------


@pytest.mark.parametrize("stream_options,is_set,include_usage", [
    (None, False, False), ({}, False, False), ({"include_usage": None}, False, False),
    ({"include_usage": True}, True, True), ({"include_usage": False}, True, False),
])
def test_stream_options_reach_the_backend_only_when_chosen(stream_options, is_set, include_usage) -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port) as client:
            body = STREAM if stream_options is None else {**STREAM, "stream_options": stream_options}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            sent = chat.fake.requests[0]
            assert sent.HasField("stream_options") is is_set
            assert sent.stream_options.include_usage is include_usage

    run(scenario)


def test_include_usage_frames_byte_for_byte() -> None:
    async def scenario() -> None:
        async with backend(usage_last) as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions",
                                      json={**STREAM, "stream_options": {"include_usage": True}})
            first, final, usage, done = reply.text.split("\n\n")[:4]
            sent = chat.fake.requests[0]
            head = (f'{{"id":"{sent.request_id}","object":"chat.completion.chunk",'
                    f'"created":{sent.arrival_time_us // 1_000_000},"model":"m",'
                    f'"system_fingerprint":"{system_fingerprint("m", "/models/m")}",')
            assert first.startswith(f"data: {head}" + '"usage":null,"choices":[{"index":0,')
            assert final.startswith(f"data: {head}" + '"usage":null,"choices":[{"index":0,')
            assert final.endswith('"finish_reason":"stop"}]}')
            assert usage == "data: " + head + '"usage":' + json.dumps(USAGE_JSON, separators=(",", ":")) \
                + ',"choices":[]}'
            assert done == "data: [DONE]" and reply.text.endswith("data: [DONE]\n\n")

    run(scenario)


def test_openai_client_reads_the_usage_only_chunk() -> None:
    async def scenario() -> None:
        async with backend(usage_last) as chat, live_edge(chat.port) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                stream = await client.chat.completions.create(
                    model="m", messages=BODY["messages"], stream=True, stream_options={"include_usage": True})
                chunks = [c async for c in stream]
            finally:
                await client.close()
            assert [c.usage for c in chunks[:-1]] == [None, None]
            assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 6
            assert chunks[-1].usage.model_extra["queue_wait_time"] == [812, 95]

    run(scenario)


def test_a_non_stream_reply_still_has_usage_from_a_usage_only_chunk() -> None:
    async def scenario() -> None:
        async with backend(usage_last) as chat, edge_client(chat.port) as client:
            reply = (await client.post("/v1/chat/completions", json=BODY)).json()
            assert reply["usage"] == USAGE_JSON and reply["choices"][0]["message"]["content"] == "Hello there"

    run(scenario)


# -- 2. fullTextEnabled -----------------------------------------------------------

# The last two lines of the pages' "Streaming Inference 2" example; our usage
# adds the documented prompt_tokens_details, batch_size and queue_wait_time.
PAGE_FINAL = ('{"id":"endpoint_common_11","object":"chat.completion.chunk","created":1730184192,'
              '"model":"DeepSeek-R1","full_text":"Hello! How can I assist you today?","usage":'
              '{"prompt_tokens":31,"completion_tokens":10,"total_tokens":41},"choices":[{"index":0,"delta":'
              '{"role":"assistant","content":"Hello! How can I assist you today?"},"finish_reason":"length"}]}')


def test_full_text_frames_have_the_pages_shape() -> None:
    async def full_text(request):
        base = dict(id="endpoint_common_11", created=1730184192, model="DeepSeek-R1")
        for text in ("Hello", "Hello!"):
            yield chat_pb2.ChatChunk(**base, choices=[chat_pb2.ChunkChoice(
                delta=chat_pb2.ChatDelta(role="assistant", content=text))])
        yield chat_pb2.ChatChunk(
            **base, full_text="Hello! How can I assist you today?",
            usage=chat_pb2.Usage(prompt_tokens=31, completion_tokens=10, total_tokens=41),
            choices=[chat_pb2.ChunkChoice(
                delta=chat_pb2.ChatDelta(role="assistant", content="Hello! How can I assist you today?"),
                finish_reason=chat_pb2.FINISH_REASON_LENGTH)])

    async def scenario() -> None:
        async with backend(full_text) as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions", json={**STREAM, "model": "m"})
            events = reply.text.split("\n\n")
            assert events[1] == ('data: {"id":"endpoint_common_11","object":"chat.completion.chunk",'
                                 '"created":1730184192,"model":"DeepSeek-R1",'
                                 f'"system_fingerprint":"{system_fingerprint("m", "/models/m")}",'
                                 '"choices":[{"index":0,"delta":'
                                 '{"role":"assistant","content":"Hello!"},"finish_reason":null}]}')
            ours = json.loads(events[2].removeprefix("data: "))
            # The product page has no system_fingerprint; DeepSeek's requires it.
            assert ours.pop("system_fingerprint") == system_fingerprint("m", "/models/m")
            page = json.loads(PAGE_FINAL)
            assert list(ours) == list(page)  # same keys in the same order
            extra = {"prompt_tokens_details": {"cached_tokens": 0}, "batch_size": [], "queue_wait_time": []}
            assert ours == {**page, "usage": {**page["usage"], **extra}}
            assert events[3:] == ["data: [DONE]", ""]

    run(scenario)


# -- 3. API keys --------------------------------------------------------------------


def test_api_keys_guard_every_route_but_health(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated 2026-11\nfile-key\n\n")

    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port, api_keys=("k1", "k2"),
                                                  api_key_file=str(key_file)) as client:
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/m"),
                                 ("GET", "/openapi.json"), ("GET", "/docs")):
                def send(headers: dict[str, str]) -> Any:
                    return client.request(method, path, json=BODY, headers=headers)

                for headers, code, message in [({}, 702, "Authorization not passed"),
                                               ({"Authorization": "Basic azE6"}, 702, "Authorization not passed"),
                                               ({"Authorization": "Bearer"}, 702, "Authorization not passed"),
                                               ({"Authorization": "Bearer k3"}, 801, "Apikey error"),
                                               ({"Authorization": "Bearer k1x"}, 801, "Apikey error")]:
                    reply = await send(headers)
                    assert (reply.status_code, reply.json()) == (401, error_body(message, "Unauthorized", code))
                    assert reply.headers["www-authenticate"] == "Bearer"
                for key in ("k1", "k2", "file-key"):
                    assert (await send({"Authorization": f"Bearer {key}"})).status_code == 200
                assert (await send({"Authorization": "bearer  k2 "})).status_code == 200
            assert len(chat.fake.requests) == 4  # rejected requests never reach the backend
            # Each call carries its client's credential on to ChatService, which decides again.
            assert set(chat.fake.credentials) == {"Bearer k1", "Bearer k2", "Bearer file-key", "bearer  k2 "}
            assert (await client.get("/health")).status_code in (200, 503)  # not 401

    run(scenario)


def test_no_keys_means_open_with_a_warning(caplog) -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions", json=BODY, headers={"Authorization": "Bearer any"})
            assert reply.status_code == 200
            assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200

    with caplog.at_level(logging.WARNING, logger="services.common.api_keys"):
        run(scenario)
    assert any("no API keys configured" in r.getMessage() for r in caplog.records)


# -- 4. request timeout -------------------------------------------------------------

TIMEOUT_MESSAGE = "Request timeout: no complete reply within e2eTimeout (0.4 s)"


def test_timeout_mid_stream_is_a_final_802_frame_then_done_and_cancels() -> None:
    async def scenario() -> None:
        async with backend(hold_after_one) as chat, edge_client(chat.port, request_timeout_s=0.4) as client:
            reply = await client.post("/v1/chat/completions", json=STREAM)
            first, error, done = sse_payloads(reply.text)
            assert first["choices"][0]["delta"]["content"] == "first"
            assert error == {**error_body(TIMEOUT_MESSAGE, "Incomplete Generation", 802), "finish_reason": "stop"}
            assert done == "[DONE]"
            await asyncio.wait_for(chat.fake.cancelled.wait(), timeout=5)

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_before_any_output_is_http_500_802_and_cancels(stream: bool) -> None:
    async def scenario() -> None:
        async with backend(hold) as chat, edge_client(chat.port, request_timeout_s=0.4) as client:
            reply = await client.post("/v1/chat/completions", json={**BODY, "stream": stream})
            assert (reply.status_code, reply.json()) == (
                500, error_body(TIMEOUT_MESSAGE, "Incomplete Generation", 802))
            await asyncio.wait_for(chat.fake.cancelled.wait(), timeout=5)

    run(scenario)

