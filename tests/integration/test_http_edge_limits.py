"""The edge's HTTP limits over raw sockets: the server of server.py (uvloop,
the edge's httptools protocol) in-process on a free port, in front of the
fake ChatService of test_http_edge. Short limits keep the timeouts quick:
head and body read timeouts, header size and count, malformed HTTP, the
Content-Type, and clients that stop reading their reply."""
from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any, NamedTuple

import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families
from stormserve.chat.v1 import chat_pb2

from services.http_edge.config import EdgeConfig
from services.http_edge.server import build_server
from tests.integration.test_http_edge import (
    BODY,
    Backend,
    Script,
    backend,
    delta_chunk,
    error_body,
    final_chunk,
    hello,
    serving,
)

LIMITS = {"max_header_kib": 4, "max_headers": 20, "header_timeout_s": 1.0, "body_timeout_s": 1.0}
JSON_BODY = json.dumps(BODY).encode()
READ_S = 10  # only keeps a broken server from hanging the test


class Reply(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@asynccontextmanager
async def real_edge(chat_port: int, **config: Any) -> AsyncIterator[int]:
    """build_server's uvicorn on a free port; yields the port."""
    server = build_server(EdgeConfig(tokenizer_address=f"127.0.0.1:{chat_port}", drain_timeout_s=1,
                                     **{**LIMITS, **config}))
    async with serving(server) as port:
        yield port


def run_with_backend(scenario: Callable[[Backend, int], Awaitable[None]], script: Script = hello,
                     **config: Any) -> None:
    """`scenario(chat, port)` against a live edge in front of `chat`, on uvloop as in production."""
    async def main() -> None:
        async with backend(script) as chat, real_edge(chat.port, **config) as port:
            await asyncio.wait_for(scenario(chat, port), timeout=30)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


def run(scenario: Callable[[int], Awaitable[None]], script: Script = hello, **config: Any) -> None:
    """`scenario(port)` against a live edge, on uvloop as in production."""
    run_with_backend(lambda _chat, port: scenario(port), script, **config)


def parse(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = {}
    for field in fields:
        name, _, value = field.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(status_line.split()[1]), headers, body)


async def send(port: int, *pieces: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
    return reader, writer


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout=READ_S)


async def exchange(port: int, *pieces: bytes) -> Reply:
    """Send the pieces, read until the server closes: the reply must close the connection."""
    reader, writer = await send(port, *pieces)
    try:
        return parse(await until_closed(reader))
    finally:
        writer.close()


def post(content_type: bytes | None, body: bytes = JSON_BODY, extra: bytes = b"") -> bytes:
    typed = b"Content-Type: " + content_type + b"\r\n" if content_type is not None else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n" + typed + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def assert_error(reply: Reply, status: int, error_type: str) -> None:
    assert reply.status == status, reply
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["connection"] == "close"
    body = reply.json()
    assert body == error_body(body["message"], error_type, status)


# -- header size and count -----------------------------------------------------


def test_a_head_above_the_size_limit_is_431() -> None:
    async def scenario(port: int) -> None:
        big = b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Big: " + b"a" * (1024 * 1024) + b"\r\n\r\n"
        reply = await exchange(port, big)
        assert_error(reply, 431, "Request Header Fields Too Large")
        assert reply.json()["message"] == "Request header fields exceed 4 KiB"

    run(scenario)


def test_an_oversized_field_is_refused_before_it_ends() -> None:
    async def scenario(port: int) -> None:
        # 5 KiB of one field and nothing more: the head never completes, yet it is over the limit.
        reply = await exchange(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 5 * 1024)
        assert_error(reply, 431, "Request Header Fields Too Large")

    run(scenario)


def test_many_small_fields_above_the_size_limit_are_431() -> None:
    async def scenario(port: int) -> None:
        fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 400) for i in range(12))  # 12 < max_headers
        reply = await exchange(port, b"GET /health HTTP/1.1\r\n" + fields + b"\r\n")
        assert_error(reply, 431, "Request Header Fields Too Large")

    run(scenario)


def test_too_many_fields_are_431() -> None:
    async def scenario(port: int) -> None:
        fields = b"".join(b"X-F%d: v\r\n" % i for i in range(10_000))
        reply = await exchange(port, b"GET /health HTTP/1.1\r\n" + fields + b"\r\n")
        assert_error(reply, 431, "Request Header Fields Too Large")
        assert reply.json()["message"] == "Request has more than 20 header fields"

    run(scenario)


def test_a_head_within_both_limits_is_served() -> None:
    async def scenario(port: int) -> None:
        fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 100) for i in range(17))  # 20 fields, ~2.2 KiB
        reply = await exchange(port, b"GET /health HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n"
                               + fields + b"\r\n")
        assert reply.status == 200

    run(scenario)


def test_protocol_refusals_are_counted_in_the_edge_metrics() -> None:
    def counts(text: str) -> dict[tuple[str, frozenset], float]:
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    async def scenario(port: int) -> None:
        await exchange(port, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 5 * 1024)  # 431
        await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")  # 400
        await exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nX-Slow: ")  # 408
        reply = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n\r\n")
        samples = counts(reply.body.decode())
        for code in ("431", "400", "408"):
            labels = frozenset({"method": "_OTHER", "route": "unparsed", "code": code}.items())
            assert samples[("stormserve:http_requests_total", labels)] == 1, code
        for reason, count in (("validation", 2), ("timeout", 1), ("auth", 0)):
            assert samples[("stormserve:requests_rejected_total", frozenset({"reason": reason}.items()))] == count

    run(scenario)


# -- read timeouts -------------------------------------------------------------


def test_a_stalled_head_is_408_and_closed() -> None:
    async def scenario(port: int) -> None:
        started = time.monotonic()
        reply = await exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nX-Slow: ")
        assert_error(reply, 408, "Request Timeout")
        assert reply.json()["message"] == "Request head not received within 1 s"
        assert time.monotonic() - started >= 0.9

    run(scenario)


def test_the_head_timeout_counts_from_connection_open_not_from_the_last_byte() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await send(port)
        trickle = asyncio.create_task(trickle_bytes(writer, b"GET /health HTTP/1.1\r\nHost: edge\r\n" * 10))
        try:
            assert_error(parse(await until_closed(reader)), 408, "Request Timeout")
            assert not trickle.done()  # cut while the client was still sending
        finally:
            trickle.cancel()
            writer.close()

    run(scenario)


async def trickle_bytes(writer: asyncio.StreamWriter, data: bytes) -> None:
    for i in range(len(data)):
        writer.write(data[i:i + 1])
        await asyncio.sleep(0.1)


def test_a_connection_that_sends_nothing_is_closed() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await send(port)
        assert await until_closed(reader) == b""
        writer.close()

    run(scenario)


def test_a_stalled_head_after_a_kept_alive_request_is_408() -> None:
    async def scenario(port: int) -> None:
        reader, writer = await send(port, b"GET /health HTTP/1.1\r\nHost: edge\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=READ_S)
        assert first.startswith(b"HTTP/1.1 200 ")
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        assert_error(parse(await until_closed(reader)), 408, "Request Timeout")
        writer.close()

    run(scenario)


def test_a_stalled_body_is_408_and_closed() -> None:
    async def scenario(port: int) -> None:
        head = post(b"application/json", body=b"x" * 100)[:-100]  # declares 100 bytes
        reply = await exchange(port, head + JSON_BODY[:10])
        assert_error(reply, 408, "Request Timeout")
        assert reply.json()["message"] == "Request body not received within 1 s"

    run(scenario)


async def slow_final(request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatChunk]:
    yield delta_chunk(request, "Hello")
    await asyncio.sleep(1.5)
    yield final_chunk(request, " there")


def test_a_reply_slower_than_the_head_timeout_is_not_cut() -> None:
    async def scenario(port: int) -> None:
        stream = json.dumps({**BODY, "stream": True}).encode()
        # The stray CRLF after the body (RFC 9112 §2.2) must not start the head clock mid-reply.
        reply = await exchange(port, post(b"application/json", stream) + b"\r\n")
        assert reply.status == 200
        assert b"data: [DONE]" in reply.body and reply.body.endswith(b"\r\n0\r\n\r\n")  # chunked, whole

    run(scenario, script=slow_final)


# -- malformed HTTP ------------------------------------------------------------


@pytest.mark.parametrize("garbage", [
    b"\x00\x01\x02 garbage\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nBad Header Name: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
])
def test_malformed_http_is_400_with_the_merged_body(garbage: bytes) -> None:
    async def scenario(port: int) -> None:
        reply = await exchange(port, garbage)
        assert_error(reply, 400, "Bad Request")
        assert reply.json()["message"].startswith("Invalid HTTP request: ")

    run(scenario)


# -- Content-Type --------------------------------------------------------------


@pytest.mark.parametrize("content_type", [
    b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x", b"", None,
])
def test_a_chat_post_that_is_not_json_is_415(content_type: bytes | None) -> None:
    async def scenario(port: int) -> None:
        reply = await exchange(port, post(content_type))
        assert reply.status == 415
        assert reply.json() == error_body(reply.json()["message"], "Unsupported Media Type", 415)
        assert reply.json()["message"].startswith("Content-Type must be application/json")

    run(scenario)


@pytest.mark.parametrize("content_type", [
    b"application/json", b"application/json; charset=utf-8", b"Application/JSON;Charset=UTF-8",
])
def test_a_json_chat_post_is_served(content_type: bytes) -> None:
    async def scenario(port: int) -> None:
        reply = await exchange(port, post(content_type))
        assert reply.status == 200, reply
        assert reply.json()["choices"][0]["message"]["content"] == "Hello there"

    run(scenario)


def test_the_api_key_check_comes_before_the_content_type() -> None:
    async def scenario(port: int) -> None:
        assert (await exchange(port, post(b"text/plain"))).status == 401
        keyed = post(b"text/plain", extra=b"Authorization: Bearer sk-1\r\n")
        assert (await exchange(port, keyed)).status == 415

    run(scenario, api_keys=("sk-1",))


# -- clients that stop reading -------------------------------------------------


async def endless_big_chunks(request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatChunk]:
    while True:
        yield delta_chunk(request, "x" * 16384)
        await asyncio.sleep(0.002)


async def one_mib_reply(request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatChunk]:
    for _ in range(64):
        yield delta_chunk(request, "x" * 16384)
    yield final_chunk(request)


def stalled_request(port: int, stream: bool) -> socket.socket:
    """A chat request from a client that never reads its reply."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(post(b"application/json", json.dumps({**BODY, "stream": stream}).encode()))
    return sock


async def until_dropped(sock: socket.socket) -> None:
    """Return once the server has reset or closed `sock`, seen without reading from it."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLERR | select.POLLHUP)
    while not poller.poll(0):
        await asyncio.sleep(0.05)


def read_what_is_left(sock: socket.socket) -> bytes:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    received = b""
    with suppress(ConnectionResetError):
        while piece := sock.recv(1 << 16):
            received += piece
    return received


# The edge's buffer is as large as it gets: only the stall timer can end these requests in time.
STALL = {"stream_stall_timeout_s": 1.0, "stream_buffer_kib": 65536}


def test_a_stream_whose_client_stops_reading_is_cancelled_and_reset() -> None:
    async def scenario(chat: Backend, port: int) -> None:
        sock = stalled_request(port, stream=True)
        try:
            await until_dropped(sock)
            await chat.fake.cancelled.wait()
            assert b"data: [DONE]" not in read_what_is_left(sock)
        finally:
            sock.close()

    run_with_backend(scenario, endless_big_chunks, **STALL)


def test_a_whole_reply_its_client_stops_reading_is_dropped_with_the_connection() -> None:
    """A non-stream reply is written in one piece, so the app is done with it
    before the client can fall behind: the stall timer frees the megabyte
    waiting in the connection."""
    async def scenario(chat: Backend, port: int) -> None:
        sock = stalled_request(port, stream=False)
        try:
            await until_dropped(sock)
            reply = parse(read_what_is_left(sock))
            assert reply.status == 200
            assert len(reply.body) < int(reply.headers["content-length"])  # cut short
        finally:
            sock.close()

    run_with_backend(scenario, one_mib_reply, **STALL)


def test_a_stream_that_falls_more_than_its_buffer_behind_is_cancelled() -> None:
    async def scenario(chat: Backend, port: int) -> None:
        sock = stalled_request(port, stream=True)
        try:
            await chat.fake.cancelled.wait()
        finally:
            sock.close()

    run_with_backend(scenario, endless_big_chunks, stream_buffer_kib=16, stream_stall_timeout_s=600.0)
