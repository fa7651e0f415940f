"""A small HTTP server on loopback that serves media well and badly, the
media test files, and what a client reads of a MediaRefused."""
from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import grpc
from PIL import Image
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.errors import ErrorInterceptor
from services.common.multiplex import serve_calls
from services.common.multiplex_client import CallMultiplexer
from services.http_edge.errors import from_rpc_error
from services.tokenizer.media import MediaRefused

Route = Callable[[asyncio.StreamWriter, "HttpServer"], Awaitable[None]]


def png(width: int = 4, height: int = 3, color=(200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_claiming(width: int, height: int) -> bytes:
    """A PNG header that declares width x height pixels, with a few bytes of
    image data: what a decompression bomb looks like before it is decoded."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grey
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 1024)) + _png_chunk(b"IEND", b""))


def gif(num_frames: int) -> bytes:
    frames = [Image.new("L", (2, 2), i * 5 % 256) for i in range(num_frames)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=10)
    return out.getvalue()


def wav(seconds: float, rate: int = 200, declared_bytes: int | None = None) -> bytes:
    """`seconds` of 8-bit mono PCM; the header may declare another size (a streamed WAV's 0xFFFFFFFF)."""
    size = int(seconds * rate)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    declared = size if declared_bytes is None else declared_bytes
    return (b"RIFF" + struct.pack("<I", (36 + declared) & 0xFFFFFFFF) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt))
            + fmt + b"data" + struct.pack("<I", declared) + b"\x80" * size)


def mp4(seconds: int, timescale: int = 1000) -> bytes:
    """ftyp and a moov whose mvhd (version 0) declares `seconds`."""
    def box(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", 8 + len(body)) + kind + body
    mvhd = box(b"mvhd", b"\x00\x00\x00\x00" + struct.pack(">IIII", 0, 0, timescale, seconds * timescale)
               + b"\x00" * 80)
    return box(b"ftyp", b"isom\x00\x00\x02\x00isomiso2mp41") + box(b"moov", mvhd)


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@dataclass
class HttpServer:
    """HTTP/1.1 on 127.0.0.1: one route per path, one request per connection.
    `requests` records (path, Host header) as received."""

    routes: dict[str, Route]
    requests: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    bytes_sent: dict[str, int] = field(default_factory=dict)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            host = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("host:")),
                        "")
            self.requests.append((path, host))
            route = self.routes.get(path.split("?")[0])
            if route is None:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            else:
                await route(writer, self)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def body(data: bytes, content_type: str = "application/octet-stream", extra: str = "") -> Route:
    async def route(writer: asyncio.StreamWriter, _: HttpServer) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n{extra}"
                     "Connection: close\r\n\r\n".encode() + data)
    return route


def redirect(location: str, status: int = 302) -> Route:
    async def route(writer: asyncio.StreamWriter, _: HttpServer) -> None:
        writer.write(f"HTTP/1.1 {status} Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())
    return route


def endless(name: str, chunk: bytes = b"\x89PNG\r\n\x1a\n" + b"\x00" * 65528) -> Route:
    """200 with no length and bytes until the client goes away; counts what it sent."""
    async def route(writer: asyncio.StreamWriter, server: HttpServer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        server.bytes_sent[name] = 0
        while True:
            writer.write(chunk)
            await writer.drain()
            server.bytes_sent[name] += len(chunk)
    return route


def silent() -> Route:
    """Takes the request and never answers."""
    async def route(writer: asyncio.StreamWriter, _: HttpServer) -> None:
        await asyncio.Event().wait()
    return route


def drip(interval_s: float) -> Route:
    """Answers at once, then one byte per interval, for ever: every read is quick, the whole never ends."""
    async def route(writer: asyncio.StreamWriter, _: HttpServer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while True:
            writer.write(b"\x00")
            await writer.drain()
            await asyncio.sleep(interval_s)
    return route


@asynccontextmanager
async def http_server(routes: dict[str, Route]) -> AsyncIterator[HttpServer]:
    server = HttpServer(routes)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()


class _Refusing(chat_pb2_grpc.ChatServiceServicer):
    """Chat and ChatStream whose every call raises the refusal it is given."""

    def __init__(self, refused: MediaRefused):
        self.refused = refused

    async def _handle(self, request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatResponse]:
        raise self.refused
        yield  # a generator, as a real handler

    async def Chat(self, request, context):
        async for response in self._handle(request):
            yield response.chunk

    async def ChatStream(self, request_iterator, context):
        async with aclosing(serve_calls(request_iterator, self._handle, chat_pb2.ChatStreamResponse,
                                        chat_pb2.ChatStreamEvent)) as batches:
            async for batch in batches:
                yield batch


async def client_answer(refused: MediaRefused) -> tuple[int, dict]:
    """The HTTP status and body the edge answers for `refused` raised in the
    tokenizer, over real gRPC: the same on the multiplexed ChatStream the edge
    uses and on the plain Chat RPC an internal caller uses."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    chat_pb2_grpc.add_ChatServiceServicer_to_server(_Refusing(refused), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    answers = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = chat_pb2_grpc.ChatServiceStub(channel)
            calls = CallMultiplexer(stub.ChatStream, chat_pb2.ChatStreamRequest)
            for call in (calls.start(chat_pb2.ChatRequest(request_id="r")), stub.Chat(chat_pb2.ChatRequest())):
                try:
                    await call.read()
                except grpc.aio.AioRpcError as exc:
                    error = from_rpc_error(exc)
                    answers.append((error.status, error.body()))
            await calls.close()
    finally:
        await server.stop(None)
    assert len(answers) == 2 and answers[0] == answers[1], answers
    return answers[0]


async def expect_answer(refusal: MediaRefused, status: int, where: str, words: str) -> None:
    """`refusal` is about the part `where`, says `words`, and the client reads
    `status` with the documented body naming the part and the reason."""
    assert refusal.status == status and refusal.where == where and words in refusal.reason, refusal.message
    http_status, answer = await client_answer(refusal)
    error_type = {422: "Input Validation Error", 413: "Payload Too Large"}[status]
    message = f"{where}: {refusal.reason}"
    assert http_status == status
    assert answer == {"error": message, "error_type": error_type, "code": status, "result": None, "message": message}
