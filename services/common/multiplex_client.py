"""The client side of a multiplexed stream (multiplex.py says what the stream
carries): `CallMultiplexer` starts calls on one stream, opened on first use,
and `MultiplexedCall` reads one of them like grpc.aio's UnaryStreamCall."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.rpc import status_pb2

from services.common import tracing
from services.common.errors import DRAIN_REFUSED, STATUS_CODES, status_trailers


def _error(code: grpc.StatusCode, details: str,
           trailers: tuple[tuple[str, bytes], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details=details)



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
        where calls are to ask for them (`packed_tokens`, and `packed_token_runs`:
        it reads PackedTokens.run_lengths)."""
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
            start.packed_tokens = start.packed_token_runs = True
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
        except ValueError as exc:  # `unpack` could not read a response's packed entries
            error = _error(grpc.StatusCode.INTERNAL, f"the multiplexed stream sent unreadable packed entries: {exc}")
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
