"""The schedulers of every serving group as ChatServicer calls them: one
SchedulerClient each, a GroupPicker choosing per request (groups.py).

A group whose scheduler goes away fails only the calls it has in flight (with
the same error as a lone scheduler lost), and is passed over from then on,
until its health answers SERVING again (`follow`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from services.common.grpc_server import is_serving
from services.common.multiplex import MultiplexedCall
from services.tokenizer.groups import GroupPicker
from stormserve.scheduler.v1 import scheduler_pb2

log = logging.getLogger(__name__)


class GroupCall:
    """A Generate call on one group, read like the call it wraps; `cancel` (which the
    caller does once it is done) ends its count in flight there."""

    def __init__(self, call: MultiplexedCall, on_end: Callable[[], None],
                 on_unavailable: Callable[[], None]):
        self._call = call
        self._on_end = on_end
        self._on_unavailable = on_unavailable
        self._ended = False

    async def __aiter__(self):
        try:
            async for response in self._call:
                yield response
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._on_unavailable()
            raise

    def cancel(self) -> None:
        self._call.cancel()
        if not self._ended:
            self._ended = True
            self._on_end()


class SchedulerGroups:
    """`clients` by group name (the scheduler's address), with `channels` for health."""

    def __init__(self, clients: dict, channels: dict[str, grpc.aio.Channel] | None = None,
                 picker: GroupPicker | None = None):
        self.clients = dict(clients)
        self.channels = dict(channels or {})
        self.picker = picker or GroupPicker(list(self.clients))
        for name in self.clients:
            self.picker.add(name)
        self._group_of: dict[str, str] = {}  # request_id -> group, while in flight

    def generate(self, request: scheduler_pb2.GenerateRequest) -> GroupCall:
        name = self.picker.pick(request.prompt_token_ids)
        self._group_of[request.request_id] = name

        def on_end() -> None:
            self.picker.finish(name)
            if self._group_of.get(request.request_id) == name:
                del self._group_of[request.request_id]

        def on_unavailable() -> None:
            if self.picker.is_serving(name) and len(self.clients) > 1:
                log.warning("scheduler %s unavailable: new requests go to the other groups", name)
            self.picker.set_serving(name, False)

        return GroupCall(self.clients[name].generate(request), on_end, on_unavailable)

    async def abort(self, request: scheduler_pb2.AbortRequest) -> scheduler_pb2.AbortResponse:
        name = self._group_of.get(request.request_id) or self.picker.groups[0]
        return await self.clients[name].abort(request)

    async def follow(self, on_serving: Callable[[bool], Awaitable[None]], poll_s: float,
                     probe: Callable[[grpc.aio.Channel], Awaitable[bool]] = is_serving) -> None:
        """Forever: each group's health every `poll_s`; `on_serving(any group serves)`
        whenever that changes."""
        serving = None
        while True:
            states = await asyncio.gather(*(probe(self.channels[name]) for name in self.channels))
            for name, state in zip(self.channels, states):
                if state != self.picker.is_serving(name) and len(self.channels) > 1:
                    log.info("scheduler %s serving: %s", name, state)
                self.picker.set_serving(name, state)
            now = any(states)
            if now != serving:
                serving = now
                await on_serving(now)
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
        for chan in self.channels.values():
            await chan.close()


def group_addresses(scheduler_address: str, scheduler_addresses: Sequence[str]) -> list[str]:
    """The schedulers to use: the list when given, else the one address."""
    return list(dict.fromkeys(scheduler_addresses)) or [scheduler_address]
