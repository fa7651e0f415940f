"""The tokenizer's gRPC door with API keys, in-process over a scripted
scheduler: every RPC of ChatService and TokenizerService wants a key (health
does not), a multiplexed call is checked per call by its own credential, and
a key's concurrent-stream limit holds under a burst, refused with
RESOURCE_EXHAUSTED and a retry delay that a client can read."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from transformers import AutoTokenizer

from services.common.api_keys import KeyStore
from services.common.errors import STATUS_DETAILS_KEY, ErrorInterceptor, error_reason
from services.common.model_files import default_model_path, resolve_model
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.key_gate import KeyGate, KeyMetrics
from services.tokenizer.server import ChatServicer, TokenizerCore, TokenizerServicer
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from stormserve.scheduler.v1 import scheduler_pb2
from stormserve.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

KEY = "sk-door-1"
GOOD = (("authorization", f"Bearer {KEY}"),)
WRONG = (("authorization", "Bearer sk-nope"),)
REQUEST = chat_pb2.ChatRequest(model="m", messages=[chat_pb2.ChatMessage(role="user", content="hi")], max_tokens=1)


class HeldGenerate:
    """A Generate call that answers one token once `release` is set."""

    def __init__(self, release: asyncio.Event):
        self.release = release

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        await self.release.wait()
        yield scheduler_pb2.GenerateResponse(tokens=[scheduler_pb2.GeneratedToken(token_id=42, batch_size=1)],
                                             finish_reason=scheduler_pb2.FINISH_REASON_LENGTH)

    def cancel(self) -> bool:
        return True


class Scheduler:
    def __init__(self):
        self.release = asyncio.Event()
        self.num_calls = 0

    def generate(self, request):
        self.num_calls += 1
        return HeldGenerate(self.release)

    async def abort(self, request):
        return scheduler_pb2.AbortResponse()


@pytest.fixture(scope="module")
def core():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    core = TokenizerCore(TokenizerConfig(model_name="m"), tokenizer, "/models/m", 8192)
    yield core
    core.prompts.close()


@asynccontextmanager
async def tokenizer_door(core, tmp_path, settings: str = "") -> AsyncIterator[tuple]:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY} name=door {settings}\n")
    registry = CollectorRegistry()
    gate = KeyGate(KeyStore(key_file=str(key_file)), KeyMetrics(registry))
    scheduler = Scheduler()
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    chat_pb2_grpc.add_ChatServiceServicer_to_server(ChatServicer(core, scheduler, gate), server)
    tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(TokenizerServicer(core, gate), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel, scheduler, registry
    finally:
        await channel.close()
        await server.stop(None)


def every_call(channel):
    """One call of each RPC of both services, as (name, coroutine-maker(metadata))."""
    chat = chat_pb2_grpc.ChatServiceStub(channel)
    tokens = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

    async def chat_call(metadata):
        return [r async for r in chat.Chat(REQUEST, metadata=metadata)]

    async def chat_stream(metadata):
        call = chat.ChatStream(metadata=metadata)
        await call.write(chat_pb2.ChatStreamRequest(call_id=1, start=REQUEST, metadata=dict(metadata)))
        while True:
            for event in (await call.read()).events:
                if event.WhichOneof("event") == "end":
                    await call.done_writing()
                    if event.end.code:
                        raise grpc.aio.AioRpcError(grpc.StatusCode(next(c for c in grpc.StatusCode
                                                                       if c.value[0] == event.end.code)),
                                                   grpc.aio.Metadata(), grpc.aio.Metadata(), event.end.message)
                    return event

    return {
        "Chat": chat_call,
        "ChatStream": chat_stream,
        "ListModels": lambda metadata: chat.ListModels(chat_pb2.ListModelsRequest(), metadata=metadata),
        "Tokenize": lambda metadata: tokens.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), metadata=metadata),
        "Detokenize": lambda metadata: tokens.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=[42]),
                                                         metadata=metadata),
        "ApplyChatTemplate": lambda metadata: tokens.ApplyChatTemplate(
            tokenizer_pb2.ApplyChatTemplateRequest(messages=REQUEST.messages), metadata=metadata),
    }


def test_every_rpc_of_both_services_wants_a_key_and_health_does_not(core, tmp_path) -> None:
    async def scenario() -> None:
        async with tokenizer_door(core, tmp_path) as (channel, scheduler, _):
            scheduler.release.set()
            calls = every_call(channel)
            methods = {m.name for s in (chat_pb2.DESCRIPTOR.services_by_name["ChatService"],
                                        tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"])
                       for m in s.methods}
            assert set(calls) == methods  # a new RPC must be added here, and to the gate
            for name, call in calls.items():
                for metadata, message in (((), "Authorization not passed"), (WRONG, "Apikey error")):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(metadata)
                    assert (refused.value.code(), refused.value.details()) == (
                        grpc.StatusCode.UNAUTHENTICATED, message), name
                await call(GOOD)
            assert scheduler.num_calls == 2  # only the two keyed chat calls got through
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert reply is not None

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_burst_past_a_keys_stream_limit_is_refused_with_a_retry_delay(core, tmp_path) -> None:
    async def scenario() -> None:
        async with tokenizer_door(core, tmp_path, "max_concurrent=2") as (channel, scheduler, registry):
            chat = chat_pb2_grpc.ChatServiceStub(channel)
            calls = [chat.Chat(REQUEST, metadata=GOOD) for _ in range(6)]
            # Each read returns once its call has an answer: the held two have none yet.
            reads = [asyncio.ensure_future(call.read()) for call in calls]
            await asyncio.wait(reads, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.5)
            held = [r for r in reads if not r.done()]
            assert len(held) == 2
            for read in reads:
                if read in held:
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    read.result()
                error = raised.value
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert error.details() == "API key door is over its limit of 2 streams at once; retry after 1 s"
                trailers = error.trailing_metadata()
                assert error_reason(trailers) == "RATE_LIMITED"
                assert dict(trailers)["retry-after"] == "1"
                status = status_pb2.Status.FromString(dict(trailers)[STATUS_DETAILS_KEY])
                retry = error_details_pb2.RetryInfo()
                assert any(d.Unpack(retry) for d in status.details) and retry.retry_delay.seconds == 1
            scheduler.release.set()
            for read in held:
                assert (await read).chunk.choices[0].finish_reason == chat_pb2.FINISH_REASON_LENGTH
            text = generate_latest(registry).decode()
            assert 'stormserve:api_key_requests_total{key="door",outcome="admitted"} 2.0' in text
            assert 'stormserve:api_key_requests_total{key="door",outcome="concurrency_limited"} 4.0' in text
            assert KEY not in text
            # Once they ended, the key has its streams back.
            await asyncio.sleep(0.2)
            assert [r async for r in chat.Chat(REQUEST, metadata=GOOD)]

    asyncio.run(asyncio.wait_for(scenario(), 60))
