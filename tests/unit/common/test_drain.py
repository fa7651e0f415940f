"""The gRPC services' drain (services/common/drain.py, GrpcService.serve_forever,
and the multiplexed and per-request calls of services/common/multiplex.py), over
real gRPC on a local port: health turns NOT_SERVING and keeps answering, new
calls are refused with UNAVAILABLE, running calls (on a ChatStream or as Chat
RPCs) finish, the service then stops on its own; at the drain timeout what is
left ends with UNAVAILABLE naming it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.drain import Drain, check_drain_timeout
from services.common.grpc_server import GrpcService, health_status
from services.common.multiplex import call_method, multiplexed_method
from services.common.multiplex_client import CallMultiplexer

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Service(chat_pb2_grpc.ChatServiceServicer):
    """Each call answers "first", then waits for `release`, then answers "second"."""

    def __init__(self, drain: Drain):
        self.drain = drain
        self.release = asyncio.Event()
        self.cancelled: list[str] = []

    async def _chat(self, request):
        try:
            yield chat_pb2.ChatResponse(chunk=chat_pb2.ChatChunk(id="first"))
            await self.release.wait()
            yield chat_pb2.ChatResponse(chunk=chat_pb2.ChatChunk(id="second"))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    Chat = call_method(_chat)
    ChatStream = multiplexed_method(_chat, chat_pb2.ChatStreamResponse, chat_pb2.ChatStreamEvent)


@dataclass
class Running:
    service: GrpcService
    servicer: Service
    channel: grpc.aio.Channel
    stub: chat_pb2_grpc.ChatServiceStub
    calls: CallMultiplexer  # calls on one ChatStream


@asynccontextmanager
async def running(drain_timeout_s: float) -> AsyncIterator[Running]:
    service = GrpcService("test-service", "127.0.0.1", 0, drain_timeout_s)
    servicer = Service(service.drain)
    service.add(chat_pb2_grpc.add_ChatServiceServicer_to_server, servicer,
                chat_pb2.DESCRIPTOR.services_by_name["ChatService"])
    await service.start()
    await service.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    stub = chat_pb2_grpc.ChatServiceStub(channel)
    calls = CallMultiplexer(stub.ChatStream, chat_pb2.ChatStreamRequest)
    try:
        yield Running(service, servicer, channel, stub, calls)
    finally:
        await calls.close()
        await channel.close()
        await service.server.stop(None)


def ask(request_id: str) -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(request_id=request_id)


async def texts(call) -> list[str]:
    return [r.chunk.id async for r in call]


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_running_calls_finish_new_ones_are_refused_and_the_service_stops_by_itself() -> None:
    async def scenario() -> None:
        async with running(drain_timeout_s=30) as run:
            service, servicer, channel, stub, calls = run.service, run.servicer, run.channel, run.stub, run.calls
            streamed = [calls.start(ask(f"s{i}")) for i in range(3)]
            unary = stub.Chat(ask("u"))
            for call in (*streamed, unary):
                assert (await call.read()).chunk.id == "first"

            began = time.monotonic()
            service.request_stop()
            stopped = asyncio.create_task(service.serve_forever())
            await until(lambda: service.drain.draining)
            # Still answering health, as NOT_SERVING: a caller can tell draining from gone.
            assert await health_status(channel) == NOT_SERVING
            named = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="stormserve.chat.v1.ChatService"))
            assert named.status == NOT_SERVING
            # A new call on the open stream and a new RPC are refused.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await calls.start(ask("late")).read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in refused.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as refused_rpc:
                await stub.Chat(ask("late-rpc")).read()
            assert refused_rpc.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.2)
            assert not stopped.done()  # three calls and one RPC are still running

            servicer.release.set()
            for call in streamed:
                assert await texts(call) == ["second"]
            assert (await unary.read()).chunk.id == "second"
            assert await unary.read() is grpc.aio.EOF
            assert await asyncio.wait_for(stopped, 5) is True  # nothing had to be ended
            assert time.monotonic() - began < 3
            assert servicer.cancelled == []

    asyncio.run(scenario())


def test_calls_still_running_at_the_drain_timeout_end_with_unavailable_naming_it() -> None:
    async def scenario() -> None:
        async with running(drain_timeout_s=0.3) as run:
            service, servicer, channel, stub, calls = run.service, run.servicer, run.channel, run.stub, run.calls
            streamed, unary = calls.start(ask("s")), stub.Chat(ask("u"))
            for call in (streamed, unary):
                assert (await call.read()).chunk.id == "first"
            began = time.monotonic()
            service.request_stop()
            assert await asyncio.wait_for(service.serve_forever(), 10) is False
            took = time.monotonic() - began
            for call in (streamed, unary):
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await call.read()
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "drain timeout (0.3 s) passed" in ended.value.details()
            assert sorted(servicer.cancelled) == ["s", "u"]  # their handlers' cleanup ran
            assert 0.3 <= took < 0.3 + 2.5

    asyncio.run(scenario())


def test_an_idle_service_stops_at_once_and_a_stream_without_calls_ends() -> None:
    async def scenario() -> None:
        async with running(drain_timeout_s=30) as run:
            service, servicer, channel, stub, calls = run.service, run.servicer, run.channel, run.stub, run.calls
            servicer.release.set()
            assert await texts(calls.start(ask("done"))) == ["first", "second"]  # the stream stays open
            began = time.monotonic()
            service.request_stop()
            assert await asyncio.wait_for(service.serve_forever(), 10) is True
            assert time.monotonic() - began < 1.5

    asyncio.run(scenario())


def test_wait_idle_waits_for_the_extra_condition_to_hold_for_the_settle_time() -> None:
    async def scenario() -> None:
        drain = Drain()
        busy = [True]
        asyncio.get_running_loop().call_later(0.2, busy.clear)
        began = time.monotonic()
        assert await drain.wait_idle(5, lambda: not busy, settle_s=0.3)
        assert 0.5 <= time.monotonic() - began < 1.5
        with drain.carrying():
            assert not await drain.wait_idle(0.1)

    asyncio.run(scenario())


@pytest.mark.parametrize("value, ok", [(0, True), (30, True), (3600, True), (-1, False), (3601, False)])
def test_drain_timeout_range(value: float, ok: bool) -> None:
    if ok:
        check_drain_timeout(value)
    else:
        with pytest.raises(ValueError, match="drain_timeout_s"):
            check_drain_timeout(value)


def test_a_call_refused_by_a_draining_server_is_started_again_on_a_new_stream() -> None:
    """The client's next stream reaches another server (as a channel reconnecting
    to another replica after GOAWAY would); the call refused, never started, runs there."""
    async def scenario() -> None:
        async with running(drain_timeout_s=30) as old, running(drain_timeout_s=30) as new:
            stubs = iter([old.stub, new.stub])
            calls = CallMultiplexer(lambda requests: next(stubs).ChatStream(requests), chat_pb2.ChatStreamRequest)
            running_call = calls.start(ask("running"))
            assert (await running_call.read()).chunk.id == "first"
            old.service.request_stop()
            stopped = asyncio.create_task(old.service.serve_forever(stop_listening=True))
            await until(lambda: old.service.drain.draining)
            new.servicer.release.set()
            assert await texts(calls.start(ask("late"))) == ["first", "second"]  # served by the other
            # The draining one no longer listens: new RPCs on its channel go nowhere.
            assert await health_status(old.channel, timeout_s=1) is None
            old.servicer.release.set()
            assert await texts(running_call) == ["second"]
            assert await asyncio.wait_for(stopped, 5) is True
            await calls.close()

    asyncio.run(scenario())
