"""The edge against an in-process fake ChatService over real gRPC (port 0):
reply shapes, SSE bytes, status mapping, mid-stream failures, cancellation on
client disconnect, and the official openai client. The fake is a test double
for the tokenizer; the real chain is covered by tests/e2e."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from grpc_health.v1 import health, health_pb2
from grpc_health.v1 import health_pb2_grpc
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.errors import ServiceError
from services.common.fingerprint import system_fingerprint
from services.common.multiplex import call_metadata, multiplexed_method
from services.http_edge.app import create_app
from services.http_edge.config import EdgeConfig

Script = Callable[[chat_pb2.ChatRequest], AsyncIterator[chat_pb2.ChatChunk]]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def delta_chunk(request: chat_pb2.ChatRequest, content: str, finish: int = 0, **fields: Any) -> chat_pb2.ChatChunk:
    return chat_pb2.ChatChunk(
        id=request.request_id, created=request.arrival_time_us // 1_000_000, model=request.model,
        choices=[chat_pb2.ChunkChoice(index=0, delta=chat_pb2.ChatDelta(role="assistant", content=content),
                                      finish_reason=finish)],
        **fields,
    )


def final_chunk(request: chat_pb2.ChatRequest, content: str = "") -> chat_pb2.ChatChunk:
    return delta_chunk(
        request, content, chat_pb2.FINISH_REASON_STOP,
        usage=chat_pb2.Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6,
                             prompt_tokens_details=chat_pb2.PromptTokensDetails(cached_tokens=0),
                             batch_size=[1, 1], queue_wait_time=[812, 95]),
        prefill_time=41.7, decode_time_arr=[27.2],
    )


async def hello(request) -> AsyncIterator[chat_pb2.ChatChunk]:
    yield delta_chunk(request, "Hello")
    yield delta_chunk(request, " there")
    yield final_chunk(request)


def aborting(code: grpc.StatusCode, details: str, after: int = 0) -> Script:
    async def script(request):
        for _ in range(after):
            yield delta_chunk(request, "partial")
        raise ServiceError(code, details)

    return script


async def hold_after_one(request) -> AsyncIterator[chat_pb2.ChatChunk]:
    yield delta_chunk(request, "first")
    await asyncio.Event().wait()


async def hold(request) -> AsyncIterator[chat_pb2.ChatChunk]:
    await asyncio.Event().wait()
    yield delta_chunk(request, "never")


class FakeChatService(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, script: Script = hello):
        self.script = script
        self.requests: list[chat_pb2.ChatRequest] = []
        self.cancelled = asyncio.Event()
        self.num_list_models = 0
        self.credentials: list[str | None] = []  # each call's `authorization`, as the tokenizer would read it

    async def ListModels(self, request, context) -> chat_pb2.ListModelsResponse:
        self.num_list_models += 1
        self.credentials.append(dict(context.invocation_metadata()).get("authorization"))
        return chat_pb2.ListModelsResponse(models=[chat_pb2.Model(
            id="m", root="m", created=1700000000, owned_by="stormserve", max_model_len=2048,
            system_fingerprint=system_fingerprint("m", "/models/m"))])

    async def Chat(self, request, context) -> AsyncIterator[chat_pb2.ChatResponse]:
        self.requests.append(request)
        self.credentials.append(call_metadata().get("authorization"))
        try:
            async for chunk in self.script(request):
                yield chat_pb2.ChatResponse(chunk=chunk)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    # What the edge calls: the services' own multiplexing over this fake's Chat.
    ChatStream = multiplexed_method(lambda self, request: self.Chat(request, None), chat_pb2.ChatStreamResponse,
                                    chat_pb2.ChatStreamEvent)


class Backend:
    def __init__(self, fake: FakeChatService, port: int, health_servicer):
        self.fake, self.port, self.health = fake, port, health_servicer


@asynccontextmanager
async def backend(script: Script = hello) -> AsyncIterator[Backend]:
    fake = FakeChatService(script)
    server = grpc.aio.server()
    chat_pb2_grpc.add_ChatServiceServicer_to_server(fake, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Backend(fake, port, health_servicer)
    finally:
        await server.stop(None)


def edge_app(port: int, **config: Any):
    return create_app(EdgeConfig(tokenizer_address=f"127.0.0.1:{port}", **config))


@asynccontextmanager
async def edge_client(port: int, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process through httpx's ASGI transport (whole replies only)."""
    app = edge_app(port, **config)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
            yield client


@asynccontextmanager
async def serving(server: uvicorn.Server) -> AsyncIterator[int]:
    """`server` on a free local port; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = time.monotonic() + 10
    while not server.started:
        assert not task.done() and time.monotonic() < deadline, "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@asynccontextmanager
async def live_edge(port: int, **config: Any) -> AsyncIterator[str]:
    """The app under uvicorn on a free local port, for streaming and disconnects."""
    server = uvicorn.Server(uvicorn.Config(edge_app(port, **config), lifespan="on", log_config=None,
                                           timeout_graceful_shutdown=1))
    async with serving(server) as edge_port:
        yield f"http://127.0.0.1:{edge_port}"


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def error_body(message: str, error_type: str, code: int) -> dict[str, Any]:
    return {"error": message, "error_type": error_type, "code": code, "result": None, "message": message}


def test_non_stream_reply_has_the_documented_shape() -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port) as client:
            started = int(time.time())
            reply = await client.post("/v1/chat/completions", json=BODY)
            assert reply.status_code == 200
            body = reply.json()
            sent = chat.fake.requests[0]
            assert body == {
                "id": sent.request_id,
                "object": "chat.completion",
                "created": sent.arrival_time_us // 1_000_000,
                "model": "m",
                "system_fingerprint": system_fingerprint("m", "/models/m"),
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello there", "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": "stop",
                }],
                "usage": {
                    "prompt_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": 0},
                    "completion_tokens": 2,
                    "total_tokens": 6,
                    "batch_size": [1, 1],
                    "queue_wait_time": [812, 95],
                },
                "prefill_time": 42,
                "decode_time_arr": [27],
            }
            assert sent.request_id.startswith("chatcmpl-") and len(sent.request_id) == 9 + 32
            assert started <= body["created"] <= int(time.time())

    run(scenario)


def test_request_fields_reach_the_backend() -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions", json={
                **BODY, "temperature": 0.5, "top_k": 0, "seed": 2**64 - 1, "stop": "END", "max_tokens": 9,
                "chat_template_kwargs": {"enable_thinking": False}, "unknown_field": [1],
            })
            assert reply.status_code == 200
            sent = chat.fake.requests[0]
            assert sent.model == "m" and sent.messages[0].content == "hi" and not sent.stream
            assert sent.temperature == 0.5 and sent.HasField("top_k") and sent.top_k == 0
            assert sent.seed == 2**64 - 1 and list(sent.stop) == ["END"] and sent.max_tokens == 9
            assert not sent.HasField("top_p") and not sent.HasField("repetition_penalty")
            assert sent.chat_template_kwargs["enable_thinking"] is False
            assert abs(sent.arrival_time_us / 1e6 - time.time()) < 5

    run(scenario)


def test_stream_framing_byte_for_byte() -> None:
    async def fixed(request):
        base = dict(id="chatcmpl-fixed", created=1729614610, model="m")
        yield chat_pb2.ChatChunk(**base, choices=[chat_pb2.ChunkChoice(
            delta=chat_pb2.ChatDelta(role="assistant", content="Hi\n"))])
        yield chat_pb2.ChatChunk(**base, usage=chat_pb2.Usage(prompt_tokens=3, completion_tokens=1,
                                                              total_tokens=4, batch_size=[1],
                                                              queue_wait_time=[5318]),
                                 choices=[chat_pb2.ChunkChoice(
                                     delta=chat_pb2.ChatDelta(role="assistant", content="ü"),
                                     finish_reason=chat_pb2.FINISH_REASON_STOP)])

    head = ('data: {"id":"chatcmpl-fixed","object":"chat.completion.chunk","created":1729614610,"model":"m",'
            f'"system_fingerprint":"{system_fingerprint("m", "/models/m")}",')
    expected = (
        head + '"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi\\n"},"finish_reason":null}]}\n\n'
        + head + '"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens":1,'
        '"total_tokens":4,"batch_size":[1],"queue_wait_time":[5318]},'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":"ü"},"finish_reason":"stop"}]}\n\n'
        "data: [DONE]\n\n"
    ).encode()

    async def scenario() -> None:
        async with backend(fixed) as chat, live_edge(chat.port) as url, httpx.AsyncClient() as client:
            async with client.stream("POST", f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as reply:
                assert reply.status_code == 200
                assert reply.headers["content-type"] == "text/event-stream"
                raw = b"".join([piece async for piece in reply.aiter_raw()])
            assert raw == expected

    run(scenario)


# Details of the codes raised for clients are shown; any other status reads as
# a fixed message for its code.
STATUS_CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, "n > 1 is not supported yet", 422, "Input Validation Error", 422, None),
    (grpc.StatusCode.NOT_FOUND, "Model not found", 422, "Input Validation Error", 422, None),
    (grpc.StatusCode.OUT_OF_RANGE,
     "This model's maximum input ids length cannot be greater than 2048,the input ids length is 3000",
     424, "Generation Error", 9999, None),
    (grpc.StatusCode.UNAVAILABLE, "no worker", 503, "Service Unavailable", 503,
     "the service is temporarily unavailable, retry"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 503, "Service Unavailable", 503, None),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "tokenTimeout", 500, "Incomplete Generation", 802, "the request timed out"),
    (grpc.StatusCode.UNAUTHENTICATED, "bad key", 401, "Unauthorized", 801, None),
    (grpc.StatusCode.PERMISSION_DENIED, "not allowed", 401, "Unauthorized", 702, None),
    (grpc.StatusCode.INTERNAL, "boom", 500, "Incomplete Generation", 9999, "internal error"),
]


@pytest.mark.parametrize("code,details,status,error_type,doc_code,shown", STATUS_CASES,
                         ids=[c[0].name for c in STATUS_CASES])
def test_grpc_status_before_the_first_chunk_is_an_http_status(code, details, status, error_type, doc_code,
                                                              shown) -> None:
    async def scenario() -> None:
        async with backend(aborting(code, details)) as chat, edge_client(chat.port) as client:
            for stream in (False, True):
                reply = await client.post("/v1/chat/completions", json={**BODY, "stream": stream})
                assert reply.status_code == status
                assert reply.headers["content-type"] == "application/json"
                assert reply.json() == error_body(shown or details, error_type, doc_code)

    run(scenario)


def sse_payloads(raw: str) -> list[Any]:
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") if e == "data: [DONE]" else json.loads(e.removeprefix("data: "))
            for e in events]


def test_error_chunk_mid_stream_is_a_final_frame_then_done() -> None:
    async def fails_late(request):
        yield delta_chunk(request, "partial")
        # As the tokenizer sends it: the held-back text, finish_reason, usage and the error.
        failed = final_chunk(request, " tail")
        failed.error.CopyFrom(chat_pb2.ChatError(
            code=802, message="Engine callback timeout: server tokenTimeout", error_type="Incomplete Generation"))
        yield failed

    async def scenario() -> None:
        async with backend(fails_late) as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
            assert reply.status_code == 200
            first, tail, error, done = sse_payloads(reply.text)
            assert first["choices"][0]["delta"]["content"] == "partial"
            assert tail["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": " tail"},
                                       "finish_reason": None}]
            assert "usage" not in tail
            assert error == {**error_body("Engine callback timeout: server tokenTimeout",
                                          "Incomplete Generation", 802), "finish_reason": "stop"}
            assert done == "[DONE]"
            # The same failure without streaming is an HTTP 500.
            reply = await client.post("/v1/chat/completions", json=BODY)
            assert reply.status_code == 500 and reply.json()["code"] == 802

    run(scenario)


def test_grpc_failure_mid_stream_is_a_final_frame_then_done() -> None:
    async def scenario() -> None:
        script = aborting(grpc.StatusCode.INTERNAL, "worker crashed", after=2)
        async with backend(script) as chat, edge_client(chat.port) as client:
            reply = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
            assert reply.status_code == 200
            *chunks, error, done = sse_payloads(reply.text)
            assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["partial", "partial"]
            assert error == {**error_body("internal error", "Incomplete Generation", 9999), "finish_reason": "stop"}
            assert done == "[DONE]"

    run(scenario)


def test_request_timeout_is_802_and_cancels_the_backend() -> None:
    async def scenario() -> None:
        async with backend(hold) as chat, edge_client(chat.port, request_timeout_s=0.3) as client:
            reply = await client.post("/v1/chat/completions", json=BODY)
            assert reply.status_code == 500
            assert reply.json()["code"] == 802 and reply.json()["error_type"] == "Incomplete Generation"
            await asyncio.wait_for(chat.fake.cancelled.wait(), timeout=5)

    run(scenario)


def test_client_disconnect_mid_stream_cancels_the_backend_call() -> None:
    async def scenario() -> None:
        async with backend(hold_after_one) as chat, live_edge(chat.port) as url:
            async with httpx.AsyncClient() as client:
                async with client.stream("POST", f"{url}/v1/chat/completions",
                                         json={**BODY, "stream": True}) as reply:
                    lines = reply.aiter_lines()
                    assert json.loads((await anext(lines)).removeprefix("data: "))["choices"][0]["delta"][
                        "content"] == "first"
            await asyncio.wait_for(chat.fake.cancelled.wait(), timeout=5)

    run(scenario)


def test_client_disconnect_during_non_stream_wait_cancels_the_backend_call() -> None:
    async def scenario() -> None:
        async with backend(hold) as chat, live_edge(chat.port) as url:
            async with httpx.AsyncClient(timeout=0.5) as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(f"{url}/v1/chat/completions", json=BODY)
            await asyncio.wait_for(chat.fake.cancelled.wait(), timeout=5)

    run(scenario)


def test_openai_client_parses_both_modes() -> None:
    async def scenario() -> None:
        async with backend() as chat, live_edge(chat.port) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                completion = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], temperature=0)
                assert completion.choices[0].message.content == "Hello there"
                assert completion.choices[0].finish_reason == "stop"
                assert completion.usage.prompt_tokens == 4 and completion.usage.total_tokens == 6
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
                chunks = [chunk async for chunk in stream]
                assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there"
                assert chunks[-1].choices[0].finish_reason == "stop"
                assert chunks[-1].usage.completion_tokens == 2
                with pytest.raises(openai.UnprocessableEntityError) as caught:
                    await client.chat.completions.create(model="m", messages=[], temperature=0)
                assert caught.value.status_code == 422
                assert caught.value.response.json()["error_type"] == "Input Validation Error"
                models = await client.models.list()
                assert [m.id for m in models.data] == ["m"]
            finally:
                await client.close()

    run(scenario)


def test_openai_client_raises_on_a_mid_stream_error_frame() -> None:
    async def scenario() -> None:
        script = aborting(grpc.StatusCode.INTERNAL, "worker crashed", after=1)
        async with backend(script) as chat, live_edge(chat.port) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                stream = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
                with pytest.raises(openai.APIError) as caught:
                    async for _ in stream:
                        pass
                # The SDK hands over the frame's "error" member: our message string.
                assert caught.value.body == "internal error"
            finally:
                await client.close()

    run(scenario)


def test_models_are_listed_and_cached() -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port, models_cache_s=60) as client:
            reply = await client.get("/v1/models")
            assert reply.json() == {"object": "list", "data": [{
                "id": "m", "object": "model", "created": 1700000000, "owned_by": "stormserve",
                "root": "m", "parent": None, "max_model_len": 2048,
            }]}
            await client.post("/v1/chat/completions", json=BODY)
            assert (await client.get("/v1/models/m")).json()["id"] == "m"
            assert chat.fake.num_list_models == 1
            missing = await client.get("/v1/models/other")
            assert missing.status_code == 404 and missing.json()["message"] == "Model other not found."

    run(scenario)


def test_health_follows_the_backend_health_service() -> None:
    async def scenario() -> None:
        async with backend() as chat, edge_client(chat.port) as client:
            await chat.health.set("", health_pb2.HealthCheckResponse.SERVING)
            reply = await client.get("/health")
            assert (reply.status_code, reply.content) == (200, b"")
            await chat.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            reply = await client.get("/health")
            assert reply.status_code == 503 and reply.json()["error_type"] == "Service Unavailable"

    run(scenario)


def test_backend_down_is_503_never_a_hang() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]

    async def scenario() -> None:
        async with edge_client(dead_port) as client:
            reply = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
            assert reply.status_code == 503 and reply.json()["code"] == 503
            assert (await client.get("/v1/models")).status_code == 503
            assert (await client.get("/health")).status_code == 503

    run(scenario)
