"""The schedulers of every serving group as ChatServicer calls them: one
SchedulerClient each, a GroupPicker choosing per request (groups.py).

A group whose scheduler goes away fails only the calls it has in flight (with
the same error as a lone scheduler lost), and is passed over from then on,
until its health answers SERVING again (`follow`). The groups are a fixed list
(scheduler_addresses), or the ready endpoints of the schedulers' Service
(scheduler_discovery=endpointslices, `apply_slices`): a group that leaves it
gets nothing new, its running calls go on, and its channel closes after them.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc

from services.common.errors import ServiceError
from services.common.grpc_server import is_serving
from services.common.kube import Slices, merge_slices
from services.common.multiplex_client import MultiplexedCall
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
        self._calls: dict[str, int] = {}  # running calls by group
        self._retired: list[tuple[str, object, grpc.aio.Channel | None]] = []  # left, calls still running

    def set_groups(self, addresses: Iterable[str],
                   connect: Callable[[str], tuple[object, grpc.aio.Channel]]) -> None:
        """The groups are now these schedulers: new ones are connected (`connect(address)`
        gives its client and channel), gone ones retired."""
        wanted = list(dict.fromkeys(addresses))
        for name in [n for n in self.clients if n not in wanted]:
            log.info("scheduler %s left: new requests go to the other groups", name)
            self.picker.remove(name)
            self._retired.append((name, self.clients.pop(name), self.channels.pop(name, None)))
        for name in wanted:
            if name not in self.clients:
                log.info("scheduler %s joined", name)
                self.clients[name], self.channels[name] = connect(name)
                self.picker.add(name)
        self._close_idle_retired()

    def apply_slices(self, slices: Slices, port: str,
                     connect: Callable[[str], tuple[object, grpc.aio.Channel]]) -> None:
        """The ready, not terminating endpoints of the schedulers' EndpointSlices are the groups."""
        endpoints = merge_slices(slices.values(), port)
        self.set_groups(sorted(e.address for e in endpoints.values() if not e.draining), connect)

    def _close_idle_retired(self) -> None:
        for entry in [e for e in self._retired if not self._calls.get(e[0])]:
            self._retired.remove(entry)
            asyncio.get_running_loop().create_task(_close(*entry[1:]))

    def generate(self, request: scheduler_pb2.GenerateRequest) -> GroupCall:
        try:
            name = self.picker.pick(request.prompt_token_ids)
        except LookupError:  # discovery has listed no scheduler yet, or none is left
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no scheduler is ready") from None
        self._group_of[request.request_id] = name
        self._calls[name] = self._calls.get(name, 0) + 1

        def on_end() -> None:
            self.picker.finish(name)
            self._calls[name] -= 1
            if self._group_of.get(request.request_id) == name:
                del self._group_of[request.request_id]
            if self._retired:
                self._close_idle_retired()

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
            channels = list(self.channels.items())
            states = await asyncio.gather(*(probe(chan) for _, chan in channels))
            for (name, _), state in zip(channels, states):
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
        for _, client, chan in self._retired:
            await _close(client, chan)


async def _close(client, chan: grpc.aio.Channel | None) -> None:
    await client.close()
    if chan is not None:
        await chan.close()


def group_addresses(scheduler_address: str, scheduler_addresses: Sequence[str]) -> list[str]:
    """The schedulers to use: the list when given, else the one address."""
    return list(dict.fromkeys(scheduler_addresses)) or [scheduler_address]
