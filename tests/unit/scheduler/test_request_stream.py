"""RequestStream: a request's items in order, to its one reader; a reader that
waits is woken by the next item, and one cancelled while waiting leaves it usable."""
from __future__ import annotations

import asyncio

import pytest

from services.scheduler.engine import RequestStream


def test_items_come_out_in_order_one_by_one_or_all_at_once():
    async def scenario():
        stream = RequestStream()
        assert stream.empty()
        with pytest.raises(asyncio.QueueEmpty):
            stream.get_nowait()
        for item in ("a", "b", None, "c"):
            stream.put_nowait(item)
        assert not stream.empty()
        assert await stream.get() == "a"
        assert stream.get_nowait() == "b"
        assert await stream.take_all() == [None, "c"]
        assert stream.empty()

    asyncio.run(scenario())


def test_a_waiting_reader_is_woken_and_a_cancelled_one_leaves_the_stream_usable():
    async def scenario():
        stream = RequestStream()
        reader = asyncio.create_task(stream.take_all())
        await asyncio.sleep(0)  # it waits
        stream.put_nowait("x")
        stream.put_nowait("y")
        assert await reader == ["x", "y"]

        cancelled = asyncio.create_task(stream.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        stream.put_nowait("z")  # no waiter left to wake: kept for the next read
        assert await stream.get() == "z"

    asyncio.run(scenario())
