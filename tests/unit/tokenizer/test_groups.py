"""Serving-group choice: prefix affinity over the leading blocks, bounded by load,
least loaded otherwise; a group that goes away or stops serving gets nothing new."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from services.common.affinity import pick_bounded
from services.tokenizer.groups import BLOCK_TOKENS, GroupPicker, prefix_hashes
from services.tokenizer.scheduler_groups import SchedulerGroups, group_addresses
from stormserve.scheduler.v1 import scheduler_pb2

A, B, C = "a:1", "b:1", "c:1"


def prompt(conversation: int, num_blocks: int = 8) -> list[int]:
    """A shared first block (the template's), then blocks of this conversation."""
    return list(range(BLOCK_TOKENS)) + [1000 * conversation + i for i in range((num_blocks - 1) * BLOCK_TOKENS)]


def test_prefix_hashes_are_chained_whole_blocks():
    tokens = prompt(1, 4) + [7, 7, 7]  # a partial last block is not hashed
    hashes = prefix_hashes(tokens, prefix_blocks=32)
    assert len(hashes) == 4
    assert prefix_hashes(tokens, prefix_blocks=2) == hashes[:2]
    other = prompt(2, 4)
    assert prefix_hashes(other, 32)[0] == hashes[0] and prefix_hashes(other, 32)[1] != hashes[1]


def test_next_turn_goes_where_its_conversation_went():
    picker = GroupPicker([A, B])
    first = picker.pick(prompt(1))
    second = picker.pick(prompt(2))
    assert {first, second} == {A, B}  # least loaded: the shared template block is no affinity
    for name in (first, second):
        picker.finish(name)
    # Next turns: the previous prompt and more.
    assert picker.pick(prompt(2) + [5] * 3 * BLOCK_TOKENS) == second
    assert picker.pick(prompt(1) + [6] * 3 * BLOCK_TOKENS) == first


def test_new_conversations_one_at_a_time_alternate():
    picker = GroupPicker([A, B])
    picked = []
    for conversation in range(4):
        picked.append(picker.pick(prompt(conversation)))
        picker.finish(picked[-1])  # nothing in flight: the group holding fewer blocks
    assert picked == [A, B, A, B]
    assert picker.num_blocks[A] + picker.num_blocks[B] == 4 * 7 + 1  # the shared block counted once


def test_small_shared_prefix_is_not_affinity():
    picker = GroupPicker([A, B], max_imbalance=10)
    assert picker.pick(prompt(1)) == A
    # Shares only the first of its 8 blocks with A's: under half, so the least loaded.
    assert picker.pick(prompt(3)) == B


def test_affinity_passes_over_a_group_too_much_busier():
    picker = GroupPicker([A, B], max_imbalance=2)
    assert picker.pick(prompt(1)) == A
    for _ in range(2):
        picker.in_flight[A] += 1  # A: 3 in flight, B: 0
    assert picker.pick(prompt(1)) == B  # 3 > 0 + 2: the least loaded instead
    picker.finish(A)
    picker.finish(A)
    picker.finish(B)
    # B was given the conversation last: it follows there now.
    assert picker.pick(prompt(1)) == B


def test_least_loaded_then_order_without_affinity():
    picker = GroupPicker([A, B, C])
    picker.in_flight.update({A: 2, B: 1, C: 1})
    assert picker.pick(prompt(9)) == B
    assert picker.in_flight == {A: 2, B: 2, C: 1}


def test_group_not_serving_gets_nothing_while_another_does():
    picker = GroupPicker([A, B])
    assert picker.pick(prompt(1)) == A
    picker.finish(A)
    picker.set_serving(A, False)
    assert picker.pick(prompt(1)) == B
    picker.set_serving(B, False)  # none serving: the least loaded is tried, its error is the caller's
    assert picker.pick(prompt(2)) == A
    picker.set_serving(A, True)
    assert picker.pick(prompt(3)) == A


def test_removed_group_is_forgotten():
    picker = GroupPicker([A, B])
    assert picker.pick(prompt(1)) == A
    picker.remove(A)
    assert picker.groups == [B]
    assert picker.pick(prompt(1)) == B
    picker.finish(A)  # a request of the gone group ending: nothing to count
    picker.remove(B)
    with pytest.raises(LookupError):
        picker.pick(prompt(1))


def test_random_policy_spreads_over_serving_groups():
    picker = GroupPicker([A, B], policy="random", rng=random.Random(1))
    picked = {picker.pick(prompt(1)) for _ in range(20)}
    assert picked == {A, B}
    with pytest.raises(ValueError):
        GroupPicker([A], policy="sticky")


def test_remembered_blocks_are_bounded():
    picker = GroupPicker([A, B], max_remembered=10)
    for conversation in range(5):
        picker.pick(prompt(conversation))
    assert len(picker._owner) == 10


def test_pick_bounded_is_the_shared_rule():
    loads = {"x": 5, "y": 0, "z": 1}
    reuse = {"x": 100, "y": 0, "z": 50}
    assert pick_bounded(list(loads), loads.get, reuse.get, max_imbalance=1) == "z"
    assert pick_bounded(list(loads), loads.get, reuse.get, max_imbalance=5) == "x"
    assert pick_bounded(list(loads), loads.get, lambda _: 0, max_imbalance=5) == "y"


def test_group_addresses():
    assert group_addresses("s:1", ()) == ["s:1"]
    assert group_addresses("s:1", ("a:1", "b:1", "a:1")) == ["a:1", "b:1"]


class FakeCall:
    def __init__(self, responses, error=None):
        self.responses, self.error, self.cancelled = responses, error, False

    async def __aiter__(self):
        for response in self.responses:
            yield response
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeClient:
    def __init__(self, error=None):
        self.error = error
        self.requests, self.aborts = [], []

    def generate(self, request):
        self.requests.append(request)
        return FakeCall([scheduler_pb2.GenerateResponse(index=0)], self.error)

    async def abort(self, request):
        self.aborts.append(request)
        return scheduler_pb2.AbortResponse()

    async def close(self):
        pass


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "scheduler lost")


def generate(groups, request_id, conversation):
    return groups.generate(scheduler_pb2.GenerateRequest(request_id=request_id,
                                                         prompt_token_ids=prompt(conversation)))


def test_groups_route_calls_and_aborts_and_count_in_flight():
    clients = {A: FakeClient(), B: FakeClient()}
    groups = SchedulerGroups(clients)

    async def scenario():
        first, second = generate(groups, "r1", 1), generate(groups, "r2", 2)
        assert groups.picker.in_flight == {A: 1, B: 1}
        await groups.abort(scheduler_pb2.AbortRequest(request_id="r2", index=0))
        assert [len(c.aborts) for c in clients.values()] == [0, 1]
        assert [r async for r in first] == [scheduler_pb2.GenerateResponse(index=0)]
        first.cancel()
        first.cancel()  # once counted
        second.cancel()
        assert groups.picker.in_flight == {A: 0, B: 0}

    asyncio.run(scenario())


def test_lost_group_fails_its_own_calls_and_new_ones_go_elsewhere():
    clients = {A: FakeClient(error=unavailable()), B: FakeClient()}
    groups = SchedulerGroups(clients)

    async def scenario():
        on_a = generate(groups, "r1", 1)
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in on_a:
                pass
        on_a.cancel()
        assert not groups.picker.is_serving(A)
        for i in range(3):  # affinity to A no longer counts: it is not serving
            call = generate(groups, f"n{i}", 1)
            assert [r async for r in call]
            call.cancel()
        assert [len(c.requests) for c in clients.values()] == [1, 3]

    asyncio.run(scenario())


def test_follow_tracks_each_groups_health():
    groups = SchedulerGroups({A: FakeClient(), B: FakeClient()}, channels={A: "chan-a", B: "chan-b"})
    health = {"chan-a": True, "chan-b": True}
    seen = []

    async def probe(chan):
        return health[chan]

    async def on_serving(now):
        seen.append(now)
        if len(seen) == 1:
            health["chan-a"] = False
        elif len(seen) == 2:
            raise asyncio.CancelledError

    async def scenario():
        follower = asyncio.create_task(groups.follow(on_serving, 0, probe))
        while not follower.done() and groups.picker.is_serving(A):
            await asyncio.sleep(0)
        assert not groups.picker.is_serving(A) and groups.picker.is_serving(B)
        health["chan-b"] = False
        with pytest.raises(asyncio.CancelledError):
            await follower

    asyncio.run(scenario())
    assert seen == [True, False]


class Closable:
    def __init__(self):
        self.closed = False

    async def close(self):
        self.closed = True


def test_groups_follow_the_schedulers_endpointslices():
    """scheduler_discovery=endpointslices: the real watcher against a fake API server;
    ready endpoints join, a terminating one gets nothing new and its channel closes
    once its running call ends."""
    from services.common.kube import EndpointSliceWatcher, KubeApi
    from tests.fake_kube import FakeKube, endpoint_slice, slice_endpoint

    kube = FakeKube(bookmark_interval_s=1.0).start()
    connected: dict[str, tuple[FakeClient, Closable]] = {}

    def connect(address):
        connected[address] = (FakeClient(), Closable())
        return connected[address]

    def slices(*endpoints):
        return endpoint_slice("schedulers-a", "schedulers", list(endpoints), port=50052, namespace="llm")

    async def until(condition):
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out waiting for the slices")

    async def scenario():
        groups = SchedulerGroups({})
        with pytest.raises(Exception, match="no scheduler is ready"):
            generate(groups, "r0", 1)
        watcher = EndpointSliceWatcher(KubeApi(kube.url, "llm"), "schedulers",
                                       lambda found: _apply(groups, found, connect))
        task = asyncio.create_task(watcher.run())
        kube.put_slice("llm", slices(slice_endpoint("10.0.0.1", uid="s1"), slice_endpoint("10.0.0.2", uid="s2"),
                                     slice_endpoint("10.0.0.3", uid="s3", ready=False)))
        await until(lambda: groups.picker.groups == ["10.0.0.1:50052", "10.0.0.2:50052"])
        running = generate(groups, "r1", 1)  # on 10.0.0.1, the first of equals
        kube.put_slice("llm", slices(slice_endpoint("10.0.0.1", uid="s1", ready=False, terminating=True),
                                     slice_endpoint("10.0.0.2", uid="s2")))
        await until(lambda: groups.picker.groups == ["10.0.0.2:50052"])
        assert not connected["10.0.0.1:50052"][1].closed  # its call still runs
        for i in range(3):
            call = generate(groups, f"n{i}", 1)
            call.cancel()
        assert [len(connected[a][0].requests) for a in ("10.0.0.1:50052", "10.0.0.2:50052")] == [1, 3]
        running.cancel()
        await until(lambda: connected["10.0.0.1:50052"][1].closed)
        task.cancel()

    try:
        asyncio.run(scenario())
    finally:
        kube.stop()


async def _apply(groups, found, connect):
    groups.apply_slices(found, "grpc", connect)
