"""Many calls over one stream (services/common/multiplex.py), over real gRPC on
a local port: batching, per-call errors, cancellation both ways, deadlines,
and a lost stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager

import grpc
import pytest
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.errors import ServiceError
from services.common.multiplex import serve_calls
from services.common.multiplex_client import CallMultiplexer

Handler = Callable[[chat_pb2.ChatRequest], AsyncIterator[chat_pb2.ChatResponse]]


def reply(text: str) -> chat_pb2.ChatResponse:
    return chat_pb2.ChatResponse(chunk=chat_pb2.ChatChunk(id=text))


class Service(chat_pb2_grpc.ChatServiceServicer):
    """ChatStream over a scripted per-call handler; records what the server saw."""

    def __init__(self, handle: Handler):
        self.handle = handle
        self.batches: list[chat_pb2.ChatStreamResponse] = []
        self.cancelled: list[str] = []
        self.streams_ended = 0
        self.drop_stream_after_batch = False  # end the stream with UNAVAILABLE after the next batch

    async def _call(self, request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatResponse]:
        try:
            async for response in self.handle(request):
                yield response
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def ChatStream(self, request_iterator, context):
        try:
            async with aclosing(serve_calls(request_iterator, self._call, chat_pb2.ChatStreamResponse,
                                            chat_pb2.ChatStreamEvent)) as batches:
                async for batch in batches:
                    self.batches.append(batch)
                    yield batch
                    if self.drop_stream_after_batch:
                        self.drop_stream_after_batch = False
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        finally:
            self.streams_ended += 1


@asynccontextmanager
async def served(handle: Handler) -> AsyncIterator[tuple[Service, CallMultiplexer, grpc.aio.Server]]:
    service = Service(handle)
    server = grpc.aio.server()
    chat_pb2_grpc.add_ChatServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    calls = CallMultiplexer(chat_pb2_grpc.ChatServiceStub(channel).ChatStream, chat_pb2.ChatStreamRequest)
    try:
        yield service, calls, server
    finally:
        await calls.close()
        await channel.close()
        await server.stop(None)


async def hold(request: chat_pb2.ChatRequest) -> AsyncIterator[chat_pb2.ChatResponse]:
    """A call that answers once and then runs until it is cancelled."""
    yield reply("hi")
    await asyncio.Event().wait()


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait up to a second for the server side to catch up with what the client did."""
    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.01)


def sending_tasks() -> list[asyncio.Task]:
    """grpc.aio's tasks that send a stream's requests from our request iterator."""
    return [t for t in asyncio.all_tasks() if "_consume_request_iterator" in repr(t.get_coro())]


def ask(request_id: str) -> chat_pb2.ChatRequest:
    return chat_pb2.ChatRequest(request_id=request_id)


async def read_all(call) -> list[str]:
    return [r.chunk.id async for r in call]


def test_calls_interleave_and_messages_made_together_travel_together() -> None:
    steps = [asyncio.Event() for _ in range(3)]

    async def three_steps(request):
        for i, step in enumerate(steps):
            await step.wait()
            yield reply(f"{request.request_id}.{i}")

    async def scenario() -> None:
        async with served(three_steps) as (service, calls, _):
            started = [calls.start(ask(name)) for name in ("a", "b", "c")]
            readers = [asyncio.create_task(read_all(call)) for call in started]
            for step in steps:
                await asyncio.sleep(0.05)  # every call waits for the step
                step.set()
            results = await asyncio.gather(*readers)
            assert results == [[f"{n}.{i}" for i in range(3)] for n in "abc"]
            # One "step" of three calls is one message.
            sizes = [len(b.events) for b in service.batches]
            assert sizes == [3, 3, 6], sizes  # the last step and the three ends

    asyncio.run(scenario())


def test_a_failing_call_ends_with_its_status_and_the_others_go_on(caplog) -> None:
    async def handle(request):
        yield reply("first")
        if request.request_id == "bad":
            raise ServiceError(grpc.StatusCode.OUT_OF_RANGE, "too long")
        if request.request_id == "bug":
            raise RuntimeError("boom")
        yield reply("second")

    async def scenario() -> None:
        async with served(handle) as (_, calls, _server):
            bad, bug, good = calls.start(ask("bad")), calls.start(ask("bug")), calls.start(ask("good"))
            assert (await bad.read()).chunk.id == "first"
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await bad.read()
            assert failed.value.code() == grpc.StatusCode.OUT_OF_RANGE and failed.value.details() == "too long"
            with pytest.raises(grpc.aio.AioRpcError) as internal:
                await read_all(bug)
            # The exception's text goes to the log, beside the request's id, not to the caller.
            assert internal.value.code() == grpc.StatusCode.INTERNAL and internal.value.details() == "internal error"
            logged = [r for r in caplog.records if r.exc_info and "boom" in str(r.exc_info[1])]
            assert logged and "for bug" in logged[0].getMessage()
            assert await read_all(good) == ["first", "second"]
            assert await good.read() is grpc.aio.EOF

    asyncio.run(scenario())


def test_cancel_stops_the_handler_and_nothing_more_is_read() -> None:
    async def endless(request):
        i = 0
        while True:
            yield reply(str(i))
            i += 1
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        async with served(endless) as (service, calls, _):
            call, other = calls.start(ask("x")), calls.start(ask("y"))
            assert (await call.read()).chunk.id == "0"
            assert call.cancel() and not call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as cancelled:
                await call.read()
            assert cancelled.value.code() == grpc.StatusCode.CANCELLED
            await eventually(lambda: service.cancelled)
            assert service.cancelled == ["x"]
            assert (await other.read()).chunk.id == "0"  # the stream and the other call go on
            other.cancel()

    asyncio.run(scenario())


def test_a_deadline_cancels_the_call_on_the_server() -> None:
    async def scenario() -> None:
        async with served(hold) as (service, calls, _):
            call = calls.start(ask("slow"), timeout_s=0.2)
            assert (await call.read()).chunk.id == "hi"
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await call.read()
            assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: service.cancelled)
            assert service.cancelled == ["slow"]

    asyncio.run(scenario())


def test_a_lost_stream_fails_its_calls_and_the_next_call_opens_a_new_one() -> None:
    async def scenario() -> None:
        async with served(hold) as (service, calls, _):
            first, second = calls.start(ask("a")), calls.start(ask("b"))
            for call in (first, second):
                assert (await call.read()).chunk.id == "hi"
            service.drop_stream_after_batch = True
            third = calls.start(ask("c"))  # its first message is the stream's last
            assert (await third.read()).chunk.id == "hi"
            for call in (first, second, third):
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    await call.read()
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE and lost.value.details() == "going away"
            assert sorted(service.cancelled) == ["a", "b", "c"]  # the server's handlers were stopped
            # Nothing is left waiting to send on the lost stream (grpc.aio's task that
            # reads our requests), to be destroyed pending with it.
            await eventually(lambda: not sending_tasks())
            assert not sending_tasks()
            again = calls.start(ask("d"))
            assert (await again.read()).chunk.id == "hi"
            assert service.streams_ended == 1
            again.cancel()

    asyncio.run(scenario())


def test_ending_the_stream_cancels_every_running_call() -> None:
    async def scenario() -> None:
        async with served(hold) as (service, calls, _):
            started = [calls.start(ask(name)) for name in ("a", "b")]
            for call in started:
                await call.read()
            await calls.close()
            await eventually(lambda: len(service.cancelled) == 2)
            assert sorted(service.cancelled) == ["a", "b"]
            again = calls.start(ask("c"))  # a new stream
            assert (await again.read()).chunk.id == "hi"
            again.cancel()

    asyncio.run(scenario())


def test_a_failing_request_stream_ends_the_response_stream() -> None:
    """serve_calls alone: the caller's side breaking cancels the calls and ends
    the stream with that error instead of leaving it waiting."""
    held = asyncio.Event()

    async def hold(request):
        held.set()
        await asyncio.Event().wait()
        yield reply("never")

    async def requests():
        yield chat_pb2.ChatStreamRequest(call_id=1, start=ask("a"))
        await held.wait()
        raise ConnectionResetError("the caller went away")

    async def scenario() -> None:
        responses = serve_calls(requests(), hold, chat_pb2.ChatStreamResponse, chat_pb2.ChatStreamEvent)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(responses.__anext__(), timeout=5)

    asyncio.run(scenario())


def test_a_call_whose_reader_falls_behind_is_cancelled_and_its_buffer_dropped() -> None:
    async def endless(request):
        for i in range(10_000):
            yield reply(f"{request.request_id}.{i:05d}")
            await asyncio.sleep(0)

    async def scenario() -> None:
        async with served(endless) as (service, calls, _):
            stalled = calls.start(ask("stalled"), max_buffered_bytes=32768)
            other = calls.start(ask("other"))
            read = await read_all(other)  # the other call on the stream goes on to its end
            assert len(read) == 10_000
            await eventually(lambda: "stalled" in service.cancelled)
            assert service.cancelled == ["stalled"]
            assert stalled._queue.qsize() <= 1  # only the end marker: the unread messages are gone
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stalled.read()
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(scenario())
