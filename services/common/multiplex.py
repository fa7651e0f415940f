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
`CallMultiplexer` (multiplex_client.py) is the client, whose calls read like
grpc.aio's UnaryStreamCall (`read`, `async for`, `cancel`, errors as AioRpcError).

A handler either yields its call's messages (an async generator) or, answering
from callbacks (the scheduler, from its engine loop), is a coroutine that fills
messages from `call_reply()` in place and returns when the call is done: a
message then costs no task switch, no copy, and no wake-up of its own.

A stream may also carry plain messages packed column by column (the
response's `packed` field, e.g. GenerateStreamResponse.tokens): a call whose
start set `packed_tokens` gets `call_packed()`, a PackedCall, which adds one
entry and says whether it could (not once the call has an event in the
response being filled, so that each call's entries come before its events);
the client reads them with its `unpack` before the events. An entry is the
call id (the first column), a value (the second) and a tuple of the other
columns' values, which is mostly one object for many entries (the scheduler's:
a step's batch size, queue wait and latency). Consecutive entries with equal
tuples are a run; a client whose calls set `packed_token_runs` reads those
columns per run (the packed message's last column, `run_lengths`), others
per entry. The columns are built when the response is taken.

A start message's `metadata` is what a per-request RPC carries in its headers:
the caller's trace context (services/common/tracing.py), in which the
handler then runs, and its credential (`authorization`); on either RPC the
handler reads them with `call_metadata()`.
"""
from __future__ import annotations

import asyncio
import inspect
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextvars import ContextVar
from contextlib import aclosing, nullcontext
from functools import partial
from itertools import chain, repeat
from typing import Any

import grpc
from google.rpc import status_pb2

from services.common import tracing
from services.common.drain import Drain
from services.common.errors import request_id_of, status_of, status_proto


# The running call's metadata; each call runs in a task (or RPC) of its own.
_call_metadata: ContextVar[Mapping[str, Any]] = ContextVar("call_metadata", default={})
# The running call's in-place replies (see call_reply).
_call_reply: ContextVar[Callable[[type], Any] | None] = ContextVar("call_reply", default=None)
# The running call's packed entries (see call_packed); None where it did not ask for them.
_call_packed: ContextVar[PackedCall | None] = ContextVar("call_packed", default=None)


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


def call_packed() -> PackedCall | None:
    """For a coroutine handler whose call asked for packed entries, its PackedCall;
    None for every other call."""
    return _call_packed.get()


class PackedEntries:
    """The packed entries of a stream's response being filled, column by column:
    the call ids, the values, and the other columns' values in runs of entries
    that share them (mostly one object for many entries)."""

    __slots__ = ("call_ids", "values", "run_lengths", "run_shared", "evented", "wake", "runs")

    def __init__(self, wake: Callable[[], None]):
        self.call_ids: list[int] = []
        self.values: list[Any] = []
        self.run_lengths: list[int] = []
        self.run_shared: list[tuple[Any, ...]] = []
        self.evented: set[int] = set()  # the calls with an event in the response: no entry may follow one
        self.wake = wake
        self.runs = True  # the client reads runs (every packed call on the stream asked for them)

    def add_many(self, call_ids: list[int], values: Iterable[Any], shared: tuple[Any, ...]) -> bool:
        """An entry for each of several calls (in order), all with `shared`, as
        each call's PackedCall would add it; False, adding nothing, if one of
        them has an event in the response."""
        if self.evented and not self.evented.isdisjoint(call_ids):
            return False
        if not self.call_ids:
            self.wake()
        self.call_ids += call_ids
        self.values += values
        self._extend_run(len(call_ids), shared)
        return True

    def _extend_run(self, length: int, shared: tuple[Any, ...]) -> None:
        run_shared = self.run_shared
        if run_shared and run_shared[-1] == shared:
            self.run_lengths[-1] += length
        else:
            run_shared.append(shared)
            self.run_lengths.append(length)

    def fill(self, into: Any, column_names: list[str]) -> None:
        """Write the entries into the packed message `into` (its columns: the call
        ids, the values, the shared ones, then the run lengths), and start empty again."""
        first, second, *shared_names, runs_name = column_names
        getattr(into, first).extend(self.call_ids)
        getattr(into, second).extend(self.values)
        shared = self.run_shared
        if self.runs:
            getattr(into, runs_name).extend(self.run_lengths)
        else:  # a value per entry
            shared = list(chain.from_iterable(map(repeat, shared, self.run_lengths)))
        for name, column in zip(shared_names, zip(*shared)):
            getattr(into, name).extend(column)
        self.call_ids, self.values, self.run_lengths, self.run_shared = [], [], [], []


class PackedCall:
    """One call's way into its stream's packed entries: `pack(value, shared)`
    adds an entry (`shared`: the values of the columns after the value's) to the
    response being filled and returns True, or returns False, adding nothing,
    where the call must send an ordinary message instead."""

    __slots__ = ("entries", "call_id")

    def __init__(self, entries: PackedEntries, call_id: int):
        self.entries, self.call_id = entries, call_id

    def __call__(self, value: Any, shared: tuple[Any, ...]) -> bool:
        entries, call_id = self.entries, self.call_id
        if call_id in entries.evented:
            return False
        if not entries.call_ids:
            entries.wake()
        entries.call_ids.append(call_id)
        entries.values.append(value)
        entries._extend_run(1, shared)
        return True


async def _answer(handle: Callable[[Any], Any], request: Any, send: Callable[[Any], None]) -> None:
    """Run one call's handler: each message it yields goes to `send`; a
    coroutine handler sends its own through call_reply."""
    answer = handle(request)
    if inspect.iscoroutine(answer):
        await answer
        return
    async for response in answer:
        send(response)


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
    # The packed entries of the next message; their `evented` also holds the calls
    # with an event in it, whose later messages must be events too.
    column_names = ([f.name for f in response_type.DESCRIPTOR.fields_by_name[packed].message_type.fields]
                    if packed is not None else [])
    entries = PackedEntries(wake.set)
    evented = entries.evented

    def end(call_id: int, status: status_pb2.Status) -> None:
        outbox.events.add(call_id=call_id, end=status)
        evented.add(call_id)
        wake.set()

    def take_outbox() -> Any:
        nonlocal outbox
        message, outbox = outbox, response_type()
        if entries.call_ids:
            entries.fill(getattr(message, packed), column_names)
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
        _call_packed.set(PackedCall(entries, call_id) if wants_packed else None)
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
                    wants_packed = packed is not None and message.packed_tokens
                    if wants_packed and not message.packed_token_runs:
                        entries.runs = False  # a client that reads a value per entry
                    calls[message.call_id] = asyncio.create_task(run(
                        message.call_id, message.start, message.metadata, wants_packed))
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
            if outbox.events or entries.call_ids:
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
