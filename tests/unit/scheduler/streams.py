"""What the tests read a request's deliveries from: the engine's items (an
abort's empty delivery as a None), one at a time, as a Generate call would."""
from __future__ import annotations

import asyncio
from collections import deque

from services.scheduler.engine import EngineLoop, StreamItem
from services.scheduler.sequence import Sequence


class RequestStream:
    def __init__(self) -> None:
        self._items: deque[StreamItem | None] = deque()
        self._arrived = asyncio.Event()

    def __call__(self, items: list[StreamItem]) -> None:
        self._items.extend(items or [None])
        self._arrived.set()

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> StreamItem | None:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> StreamItem | None:
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        return self._items.popleft()


def submit(engine: EngineLoop, seqs: list[Sequence]) -> RequestStream:
    """`engine.submit(seqs)`, delivering to a new stream."""
    stream = RequestStream()
    engine.submit(seqs, stream)
    return stream
