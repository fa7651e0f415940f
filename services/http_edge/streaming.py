"""SSE framing and client-disconnect handling.

Framing is exactly `data: <compact json>\\n\\n` per event and a final
`data: [DONE]\\n\\n`; no `event:`/`id:` lines and no keep-alive comments.

A client that goes away must cancel the backend call (DESIGN: cancellation
flows backwards). Servers do not cancel the app when a client disconnects, so
both the wait for a non-stream reply and the event stream race the work
against the ASGI `http.disconnect` message.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ClientGone(Exception):
    """The client disconnected before the reply was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (call after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        raise ClientGone()
    finally:
        await _cancel(work_task, watcher)


class EventStreamResponse(Response):
    """A `text/event-stream` response that stops its event source, and calls
    `on_close` (which cancels the backend call), when the client disconnects,
    when the stream ends or when the server shuts down. The server writes only
    as fast as the client reads; a client that stops reading loses its
    connection to the edge's stall timer (http_protocol.py), which reads here
    as a disconnect."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], object]):
        # Not Response.__init__: it would declare the empty body's Content-Length.
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
        )
        self.events = events
        self.on_close = on_close

    async def _send_events(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_events(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if sender.done():
                with contextlib.suppress(OSError):  # ASGI 2.4 servers report a gone client here
                    sender.result()
        finally:
            await _cancel(sender, watcher)
            try:
                await self.events.aclose()  # type: ignore[attr-defined]
            finally:
                self.on_close()
