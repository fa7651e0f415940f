"""Many streaming calls over one gRPC stream (ChatStream, GenerateStream).

Every gRPC message costs tens of µs of CPU and a few thread wake-ups in each
process it passes through, and on a small machine that CPU is taken from the
worker. With one server stream per request, one engine step of 32 sequences
is 32 messages on each hop; multiplexed, it is one.

The two sides speak the same shape of messages, whatever the payload:
- requests: `call_id` and a oneof `action` of `start` (the per-call request)
  or `cancel` (true);
- responses: `events`, each with `call_id` and a oneof `event` of `response`
  (one message of the call) or `end` (a google.rpc.Status; code 0 after the
  last message).

`serve_calls` answers such a stream on the server with a per-call handler
(the per-request RPC's own logic), so both RPCs behave the same:
`call_method` and `multiplexed_method` make the two servicer methods of it;
both follow the servicer's `drain` (services/common/drain.py): once the
process drains, a new call (a new RPC, or a start on an open stream) ends with
UNAVAILABLE, running calls go on, a stream ends once its calls are done, and
calls still running at the drain timeout end with UNAVAILABLE naming it;
`CallMultiplexer` is the client, whose calls read like grpc.aio's
UnaryStreamCall (`read`, `async for`, `cancel`, errors as AioRpcError).

A handler either yields its call's messages (an async generator) or, answering
from callbacks (the scheduler, from its engine loop), is a coroutine that fills
messages from `call_reply()` in place and returns when the call is done: a
message then costs no task switch, no copy, and no wake-up of its own.

A stream may also carry plain messages packed column by column (the
response's `packed` field, e.g. GenerateStreamResponse.tokens): a call whose
start set `packed_tokens` gets `call_packed()`, which adds one entry and says
whether it could (not once the call has an event in the response being
filled, so that each call's entries come before its events); the client
reads them with its `unpack` before the events.

A start message's `metadata` is what a per-request RPC carries in its headers:
the caller's trace context (services/common/tracing.py), in which the
handler then runs, and its credential (`authorization`); on either RPC the
handler reads them with `call_metadata()`.
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextvars import ContextVar
from contextlib import aclosing, nullcontext
from functools import partial
from typing import Any

import grpc
from google.rpc import status_pb2

from services.common import tracing
from services.common.drain import Drain
from services.common.errors import (
    DRAIN_REFUSED, STATUS_CODES, request_id_of, status_of, status_proto, status_trailers)


# The running call's metadata; each call runs in a task (or RPC) of its own.
_call_metadata: ContextVar[Mapping[str, Any]] = ContextVar("call_metadata", default={})
# The running call's in-place replies (see call_reply).
_call_reply: ContextVar[Callable[[type], Any] | None] = ContextVar("call_reply", default=None)
# The running call's packed entries (see call_packed); None where it did not ask for them.
_call_packed: ContextVar[Callable[..., bool] | None] = ContextVar("call_packed", default=None)


def call_metadata() -> Mapping[str, Any]:
    """The metadata of the call whose handler runs: a per-request RPC's headers
    (lower-case keys) or a multiplexed call's start `metadata`."""
    return _call_metadata.get()


def call_reply() -> Callable[[type], Any]:
    """For a coroutine handler: `reply(message_type)` returns a new, empty message
    of the running call, already queued to be sent — fill it before the next
    await. `message_type` is the call's response type (a multiplexed stream's
    event holds one in place)."""
    reply = _call_reply.get()
    assert reply is not None, "call_reply outside a call"
    return reply


def call_packed() -> Callable[..., bool] | None:
    """For a coroutine handler whose call asked for packed entries: `pack(*columns)`
    adds one (the values of the packed message's columns after the call id) to
    the response being filled, and returns False, adding nothing, where the call
    must send an ordinary message instead. None for every other call."""
    return _call_packed.get()


async def _answer(handle: Callable[[Any], Any], request: Any, send: Callable[[Any], None]) -> None:
    """Run one call's handler: each message it yields goes to `send`; a
    coroutine handler sends its own through call_reply."""
    answer = handle(request)
    if inspect.iscoroutine(answer):
        await answer
        return
    async for response in answer:
        send(response)


def _error(code: grpc.StatusCode, details: str,
           trailers: tuple[tuple[str, bytes], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details)


def _status(code: grpc.StatusCode, message: str = "") -> status_pb2.Status:
    return status_pb2.Status(code=code.value[0], message=message)


async def serve_calls(requests: AsyncIterator[Any], handle: Callable[[Any], AsyncIterator[Any]],
                      response_type: type, event_type: type, drain: Drain | None = None,
                      packed: str | None = None) -> AsyncIterator[Any]:
    """The response stream of a multiplexed RPC: answers each started call with
    `handle(start)` (see `_answer`) in a task of its own and yields everything
    produced while the previous response was being written as one
    `response_type` message.

    A cancelled call's task is cancelled (its handler's `finally` runs, as when
    gRPC cancels a call) and nothing more is sent for it. Ending the stream
    cancels every call still running. With a `drain` that has begun, new calls
    are refused and the stream ends once the running ones are done. `packed`:
    the response's field of packed entries (see the module's notes), if any."""
    outbox = response_type()  # the next message: events are added to it in place
    wake = asyncio.Event()
    calls: dict[int, asyncio.Task] = {}
    requests_done = False
    # The packed entries of the next message, a tuple each (call id first), and the
    # calls with an event in it, whose later messages must be events too.
    column_names = ([f.name for f in response_type.DESCRIPTOR.fields_by_name[packed].message_type.fields]
                    if packed is not None else [])
    rows: list[tuple[Any, ...]] = []
    evented: set[int] = set()

    def end(call_id: int, status: status_pb2.Status) -> None:
        outbox.events.add(call_id=call_id, end=status)
        evented.add(call_id)
        wake.set()

    def packer(call_id: int) -> Callable[..., bool]:
        key = (call_id,)

        def pack(*values: Any) -> bool:
            if call_id in evented:
                return False
            if not rows:
                wake.set()
            rows.append(key + values)
            return True

        return pack

    def take_outbox() -> Any:
        nonlocal outbox
        message, outbox = outbox, response_type()
        if rows:
            into = getattr(message, packed)
            for name, column in zip(column_names, zip(*rows)):
                getattr(into, name).extend(column)
            rows.clear()
        evented.clear()
        return message

    async def run(call_id: int, request: Any, metadata: Any, wants_packed: bool) -> None:
        tracing.attach(tracing.extract(metadata))  # this task's own context: never detached
        _call_metadata.set(dict(metadata))

        def send(response: Any) -> None:
            outbox.events.add(call_id=call_id, response=response)
            evented.add(call_id)
            wake.set()

        def reply(_: type) -> Any:
            response = outbox.events.add(call_id=call_id).response
            response.SetInParent()  # an empty message is still a response, not an end
            evented.add(call_id)
            wake.set()
            return response

        _call_reply.set(reply)
        _call_packed.set(packer(call_id) if wants_packed else None)
        try:
            with drain.carrying(asyncio.current_task()) if drain is not None else nullcontext():
                await _answer(handle, request, send)
            status = _status(grpc.StatusCode.OK)
        except asyncio.CancelledError:
            if drain is None or not drain.expired:
                raise  # cancelled by the caller: it expects nothing more
            status = _status(*status_of(drain.expiry_error()))
        except Exception as exc:  # noqa: BLE001 - becomes the call's status, as the interceptor does
            status = status_proto(exc, request_id_of(request))
        finally:
            calls.pop(call_id, None)
        end(call_id, status)

    async def read() -> None:
        nonlocal requests_done
        try:
            async for message in requests:
                action = message.WhichOneof("action")
                if action == "start":
                    if message.call_id in calls:
                        end(message.call_id, _status(
                            grpc.StatusCode.ALREADY_EXISTS, f"call {message.call_id} is already running on this stream"))
                        continue
                    if drain is not None and drain.draining:
                        end(message.call_id, _status(grpc.StatusCode.UNAVAILABLE, drain.refusal()))
                        continue
                    calls[message.call_id] = asyncio.create_task(run(
                        message.call_id, message.start, message.metadata, packed is not None and message.packed_tokens))
                elif action == "cancel" and (task := calls.pop(message.call_id, None)) is not None:
                    task.cancel()
            requests_done = True  # the caller will start nothing more; running calls go on
        finally:
            wake.set()  # also when reading failed: the stream then ends with that error

    reader = asyncio.create_task(read())
    unlisten = drain.listen(wake.set) if drain is not None else None
    try:
        while True:
            await wake.wait()
            wake.clear()
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            if outbox.events or rows:
                yield take_outbox()
                wake.set()  # look again: the stream may be done now
            elif (requests_done or (drain is not None and drain.draining)) and not calls:
                return
    finally:
        if unlisten is not None:
            unlisten()
        reader.cancel()
        for task in list(calls.values()):
            task.cancel()
        await asyncio.gather(reader, *calls.values(), return_exceptions=True)


def _drain_of(servicer: Any) -> Drain:
    """The servicer's `drain`; one that never begins for a servicer without."""
    return getattr(servicer, "drain", None) or Drain()


def call_method(handle: Callable[[Any, Any], Any]):
    """A servicer method for the per-request RPC whose calls `handle(self, request)`
    answers (Chat, Generate; see `_answer`), following the servicer's `drain`.
    An async generator function, as gRPC needs: it runs any other handler on a thread."""

    async def method(self, request, context):
        drain = _drain_of(self)
        drain.refuse_new()
        metadata = (context.invocation_metadata() if context is not None else None) or ()
        if tracing.enabled:
            tracing.attach(tracing.extract(metadata))  # the call's own task
        _call_metadata.set(dict(metadata))
        replies: deque[Any] = deque()
        wake = asyncio.Event()

        def send(response: Any) -> None:
            replies.append(response)
            wake.set()

        def reply(message_type: type) -> Any:
            send(message := message_type())
            return message

        _call_reply.set(reply)
        # In a task of its own, so that what a coroutine handler sends goes out while it waits.
        answering = asyncio.create_task(_answer(partial(handle, self), request, send))
        answering.add_done_callback(lambda _: wake.set())
        try:
            with drain.carrying(answering):
                while True:
                    await wake.wait()
                    wake.clear()
                    while replies:
                        yield replies.popleft()
                    if answering.done():
                        break
            if answering.cancelled():
                if not drain.expired:
                    raise asyncio.CancelledError
                raise drain.expiry_error()
            answering.result()  # its error, if it failed
        finally:
            if not answering.done():
                answering.cancel()
                await asyncio.gather(answering, return_exceptions=True)

    return method


def multiplexed_method(handle: Callable[[Any, Any], AsyncIterator[Any]], response_type: type, event_type: type,
                       packed: str | None = None):
    """A servicer method for a multiplexed RPC whose calls `handle(self, request)`
    answers, following the servicer's `drain` (`packed`: see serve_calls). An
    async generator function, as `call_method`'s; `serve_calls` is closed when
    the method ends, however it ends, so no call outlives its stream."""

    async def method(self, request_iterator, context):
        async with aclosing(serve_calls(request_iterator, partial(handle, self), response_type,
                                        event_type, _drain_of(self), packed)) as responses:
            async for response in responses:
                yield response

    return method


class _End:
    """Queued after a call's last message: how it ended."""

    def __init__(self, error: grpc.aio.AioRpcError | None):
        self.error = error


class MultiplexedCall:
    """One call on a multiplexed stream, read like grpc.aio's UnaryStreamCall.

    The stream is read eagerly for every call on it, so a call whose reader
    stops reading would hold everything it is sent. With `max_buffered_bytes`,
    a call that has more than that unread (serialized size) is cancelled, its
    messages dropped, and its reader gets RESOURCE_EXHAUSTED."""

    def __init__(self, cancel: Callable[[], None], timeout_s: float | None,
                 max_buffered_bytes: int | None = None):
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancel = cancel
        self._end: _End | None = None
        self._timer = None
        self._max_buffered_bytes = max_buffered_bytes
        self._buffered_bytes = 0
        # What started it, to start it again if a draining server refused it.
        self._request: Any = None
        self._metadata: dict[str, str] = {}
        self._received = False
        self._resent = False
        if timeout_s is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire)

    def _deliver(self, item: Any) -> None:
        if self._max_buffered_bytes is not None:
            self._buffered_bytes += item.ByteSize()
            if self._buffered_bytes > self._max_buffered_bytes:
                self._overflow()
                return
        self._queue.put_nowait(item)

    def _overflow(self) -> None:
        while not self._queue.empty():  # what the reader has not taken is dropped, not kept
            self._queue.get_nowait()
        self._buffered_bytes = 0
        self._stop(_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the reader fell more than {self._max_buffered_bytes} bytes behind"))

    def _finish(self, error: grpc.aio.AioRpcError | None) -> None:
        """The server ended the call; it reads as ended after the messages before."""
        if self._timer is not None:
            self._timer.cancel()
        self._queue.put_nowait(_End(error))

    def _stop(self, error: grpc.aio.AioRpcError) -> bool:
        """Ended here: the server is told, and reading raises `error` from now on."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._end is not None:
            return False
        self._end = _End(error)
        self._cancel()
        self._queue.put_nowait(self._end)  # wakes a reader waiting now
        return True

    def _expire(self) -> None:
        self._timer = None
        self._stop(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        """Stop the call on the server; nothing more is read. False if it had ended."""
        return self._stop(_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))

    def abort(self, code: grpc.StatusCode, details: str) -> bool:
        """As `cancel`, but the reader gets `code` and `details` (what ended it, for its client)."""
        return self._stop(_error(code, details))

    async def read(self) -> Any:
        """The next message, or grpc.aio.EOF after the last. Raises AioRpcError."""
        if self._end is None:
            item = await self._queue.get()
            if not isinstance(item, _End):
                if self._max_buffered_bytes is not None:
                    self._buffered_bytes -= item.ByteSize()
                return item
            if self._end is None:
                self._end = item
        if self._end.error is not None:
            raise self._end.error
        return grpc.aio.EOF

    async def _iterate(self) -> AsyncIterator[Any]:
        while (message := await self.read()) is not grpc.aio.EOF:
            yield message

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()


class _Stream:
    """One open multiplexed RPC and the calls started on it."""

    def __init__(self, open_stream: Callable[[AsyncIterator[Any]], Any]):
        self.outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self.calls: dict[int, MultiplexedCall] = {}
        self.rpc = open_stream(self._requests())
        self.reader: asyncio.Task | None = None

    async def _requests(self) -> AsyncIterator[Any]:
        # Ends at the None `end` queues: grpc.aio's task that reads this does not
        # stop by itself when the stream failed, and would wait here forever.
        while (message := await self.outgoing.get()) is not None:
            yield message

    def end(self) -> None:
        self.outgoing.put_nowait(None)
        self.rpc.cancel()


class CallMultiplexer:
    """The client side: one multiplexed stream, opened on first use and again
    after it failed (its calls then end with the stream's error) or after its
    server, draining, refused a call (that call is started once more on the new one)."""

    def __init__(self, open_stream: Callable[[AsyncIterator[Any]], Any], request_type: type,
                 unpack: Callable[[Any], Iterable[tuple[int, Any]]] | None = None):
        """`open_stream`: the stub's multiplexed method, e.g. `stub.ChatStream`;
        `unpack`: a response's packed entries as (call id, message), in order,
        where calls are to ask for them (`packed_tokens`)."""
        self._open_stream = open_stream
        self._request_type = request_type
        self._unpack = unpack
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    def start(self, request: Any, timeout_s: float | None = None, max_buffered_bytes: int | None = None,
              metadata: Mapping[str, str] | None = None) -> MultiplexedCall:
        """Start a call with `metadata` (as a per-request RPC's headers; the trace
        context is added); a `timeout_s` deadline cancels it and reads DEADLINE_EXCEEDED,
        more than `max_buffered_bytes` unread cancels it and reads RESOURCE_EXHAUSTED."""
        call = MultiplexedCall(lambda: None, timeout_s, max_buffered_bytes)
        call._request, call._metadata = request, {**(metadata or {}), **tracing.inject()}
        self._send(call)
        return call

    def _send(self, call: MultiplexedCall) -> None:
        """Start `call` on the open stream (opening one if none is)."""
        stream = self._stream
        if stream is None:
            stream = self._stream = _Stream(self._open_stream)
            stream.reader = asyncio.create_task(self._read(stream))
        call_id = next(self._ids)

        def cancel() -> None:
            if stream.calls.pop(call_id, None) is not None:
                stream.outgoing.put_nowait(self._request_type(call_id=call_id, cancel=True))

        call._cancel = cancel
        stream.calls[call_id] = call
        start = self._request_type(call_id=call_id, start=call._request, metadata=call._metadata)
        if self._unpack is not None:
            start.packed_tokens = True
        stream.outgoing.put_nowait(start)

    def _resend_refused(self, stream: _Stream, call: MultiplexedCall, end: status_pb2.Status) -> bool:
        """A call the server refused because it drains never started: the stream
        takes no new calls, so the next ones (this one first, once) go on a new
        stream, which a server that drains gracefully (tokenizer: it stops
        listening) lets the channel open elsewhere."""
        if end.code != grpc.StatusCode.UNAVAILABLE.value[0] or not end.message.endswith(DRAIN_REFUSED) \
                or call._received or call._resent or call._end is not None:
            return False
        if self._stream is stream:
            self._stream = None
        call._resent = True
        self._send(call)
        return True

    async def _read(self, stream: _Stream) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "the multiplexed stream ended")
        try:
            async for message in stream.rpc:
                if self._unpack is not None:
                    for call_id, response in self._unpack(message):
                        call = stream.calls.get(call_id)
                        if call is not None:
                            call._received = True
                            call._deliver(response)
                for event in message.events:
                    call = stream.calls.get(event.call_id)
                    if call is None:
                        continue  # cancelled here; the server had sent this already
                    if event.WhichOneof("event") == "response":
                        call._received = True
                        call._deliver(event.response)
                        continue
                    del stream.calls[event.call_id]
                    end = event.end
                    if self._resend_refused(stream, call, end):
                        continue
                    call._finish(None if end.code == 0 else _error(
                        STATUS_CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.message, status_trailers(end)))
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            if self._stream is stream:
                self._stream = None
            for call in stream.calls.values():
                call._finish(error)
            stream.calls.clear()
            stream.end()

    def abort_all(self, code: grpc.StatusCode, details: str) -> int:
        """End every running call as `MultiplexedCall.abort` does; how many there were."""
        calls = list(self._stream.calls.values()) if self._stream is not None else []
        return sum(call.abort(code, details) for call in calls)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and stream.reader is not None:
            stream.end()
            stream.reader.cancel()
            await asyncio.gather(stream.reader, return_exceptions=True)
