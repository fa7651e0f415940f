"""The edge's drain (server.DrainingServer, drain.py) in-process on uvloop in
front of the fake ChatService of test_http_edge: after SIGTERM /health and
new requests get 503 with the error body while running streams finish, and
the server then stops by itself; at the drain timeout a stream still running
ends with a final error frame and [DONE], a whole reply with 503."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvloop

from services.http_edge.config import EdgeConfig
from services.http_edge.server import FINAL_S, DrainingServer, build_server
from tests.integration.test_http_edge import (
    BODY,
    backend,
    delta_chunk,
    error_body,
    final_chunk,
    hold_after_one,
    serving,
)

STREAM = {**BODY, "stream": True}


@asynccontextmanager
async def edge(chat_port: int, drain_timeout_s: float) -> AsyncIterator[tuple[DrainingServer, str]]:
    server = build_server(EdgeConfig(tokenizer_address=f"127.0.0.1:{chat_port}", drain_timeout_s=drain_timeout_s))
    async with serving(server) as port:
        yield server, f"http://127.0.0.1:{port}"


async def sse_frames(client: httpx.AsyncClient, body: dict[str, Any] = STREAM) -> list[Any]:
    """A stream's `data:` payloads, parsed ([DONE] as the string)."""
    frames = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                frames.append(payload if payload == "[DONE]" else json.loads(payload))
    return frames


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def sigterm_during(server: DrainingServer, client: httpx.AsyncClient, chat,
                         num_streams: int) -> tuple[list[asyncio.Task], asyncio.Task, float]:
    """Start `num_streams` streams and one whole request; once the backend has them
    all, SIGTERM. Returns their tasks and when the signal came."""
    streams = [asyncio.create_task(sse_frames(client)) for _ in range(num_streams)]
    whole = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
    await until(lambda: len(chat.fake.requests) == num_streams + 1)
    began = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    return streams, whole, began


def run(scenario) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), timeout=30))


def assert_refused(reply: httpx.Response) -> None:
    assert reply.status_code == 503
    assert reply.headers["connection"] == "close"
    body = reply.json()
    assert body == error_body(body["message"], "Service Unavailable", 503)
    assert body["message"] == "http_edge is shutting down and takes no new requests"


def test_streams_in_flight_finish_new_requests_get_503_then_the_server_stops() -> None:
    release = asyncio.Event()

    async def slow(request):
        yield delta_chunk(request, "Hello")
        await release.wait()
        yield final_chunk(request, " there")

    async def scenario() -> None:
        async with backend(slow) as chat, edge(chat.port, drain_timeout_s=30) as (server, url):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                streams, whole, began = await sigterm_during(server, client, chat, num_streams=3)
                await until(lambda: server.drain.draining)
                async with httpx.AsyncClient(base_url=url, timeout=5) as late:
                    assert_refused(await late.get("/health"))
                    assert_refused(await late.post("/v1/chat/completions", json=STREAM))
                    assert_refused(await late.get("/v1/models"))
                await asyncio.sleep(0.3)
                assert not server.should_exit and server.drain.num_carried == 4
                release.set()
                for frames in await asyncio.gather(*streams):
                    assert frames[-1] == "[DONE]"
                    assert [f["choices"][0]["delta"].get("content") for f in frames[:-1]] == ["Hello", " there"]
                    assert frames[-2]["choices"][0]["finish_reason"] == "stop"
                    assert not any("error" in f for f in frames[:-1])
                reply = await whole
                assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello there"
                await until(lambda: server.should_exit, timeout_s=3)
                assert len(chat.fake.requests) == 4  # nothing refused reached the backend
                assert time.monotonic() - began < 2

    run(scenario)


def test_at_the_drain_timeout_streams_end_with_an_error_frame_and_replies_with_503() -> None:
    async def scenario() -> None:
        async with backend(hold_after_one) as chat, edge(chat.port, drain_timeout_s=0.5) as (server, url):
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                streams, whole, began = await sigterm_during(server, client, chat, num_streams=2)
                message = "http_edge shut down before this request finished: its drain timeout (0.5 s) passed"
                for frames in await asyncio.gather(*streams):
                    assert frames[0]["choices"][0]["delta"]["content"] == "first"
                    assert frames[-1] == "[DONE]"
                    assert frames[-2] == {**error_body(message, "Service Unavailable", 503), "finish_reason": "stop"}
                reply = await whole
                assert reply.status_code == 503 and reply.json() == error_body(message, "Service Unavailable", 503)
                await until(lambda: server.should_exit, timeout_s=5)
                assert 0.5 <= time.monotonic() - began < 0.5 + FINAL_S + 1
                await until(lambda: chat.fake.cancelled.is_set())  # the backend calls were cancelled too

    run(scenario)
