"""Moving a sequence from a prefill worker's policy to a decode worker's
(handoff.py, transfer_steps.py), on fake workers that keep "KV" per slot and
sample from the context they read back: a block sent to the wrong place, or
a recompute from the wrong position, changes the text. Transfers are the
prefill worker's SendBlocks, which here copies slots, fails, or waits."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.scheduler import handoff as handoff_module
from services.scheduler.engine import EngineLoop
from services.scheduler.handoff import Handoff
from services.scheduler.policy import BatchPolicy, WorkerCapacity
from services.scheduler.sequence import FinishReason, SequenceStatus
from services.scheduler.worker_client import WorkerError
from tests.unit.scheduler.streams import RequestStream
from tests.unit.scheduler.test_policy import BLOCK_SIZE, EOS, FakeWorker, make_seq, run_step


class PrefillClient:
    """The prefill worker's client: SendBlocks copies its fake worker's slots into the peer's."""

    address = "prefill:1"

    def __init__(self, worker: FakeWorker, failures: int = 0):
        self.worker = worker
        self.peers: dict[str, FakeWorker] = {}
        self.failures = failures
        self.calls = 0
        self.hold: asyncio.Event | None = None

    async def send_blocks(self, peer, src, dst, timeout_s):
        self.calls += 1
        if self.hold is not None:
            await self.hold.wait()
        if self.failures:
            self.failures -= 1
            raise WorkerError("SendBlocks: UNAVAILABLE: KV transfer failed")
        target = self.peers[peer]
        for s, d in zip(src, dst):
            for offset in range(BLOCK_SIZE):
                if (token := self.worker.slots.get(s * BLOCK_SIZE + offset)) is not None:
                    target.slots[d * BLOCK_SIZE + offset] = token
        return len(src) * 100, 0.001


def engine(role: str, num_blocks: int, client) -> EngineLoop:
    loop = EngineLoop(client, max_batch_size=8, max_prefill_tokens=1000)
    capacity = WorkerCapacity(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, max_batch_size=64,
                              eos_token_ids=frozenset({EOS}), role=role)
    loop.policy = BatchPolicy(capacity, 8, 1000)
    loop.info = SimpleNamespace(kv_pool=client.address if role == "decode" else None)
    loop._ready.set()
    return loop


class Pair:
    def __init__(self, failures: int = 0, decode_blocks: int = 100):
        self.p_worker, self.d_worker = FakeWorker(), FakeWorker()
        self.client = PrefillClient(self.p_worker, failures)
        d_client = SimpleNamespace(address="decode:1")
        self.client.peers[d_client.address] = self.d_worker
        self.p, self.d = engine("prefill", 100, self.client), engine("decode", decode_blocks, d_client)
        self.p_worker.policy, self.d_worker.policy = self.p.policy, self.d.policy
        self.handoff = Handoff([self.p, self.d])

    def prefill(self, seq):
        """Run the prefill worker until `seq` is sent off; its delivery is a stream."""
        seq.moves = True
        self.p.policy.add(seq)
        stream = RequestStream()
        self.p.give_delivery(seq.request_id, stream)
        while True:
            self.p._deliver(run_step(self.p.policy, self.p_worker)[1])
            if moving := self.p.policy.take_prefilled():
                break
        assert moving == [seq] and len(seq.output_token_ids) == 1
        self.handoff.on_prefilled(self.p, moving)
        return stream

    async def settle(self):
        await asyncio.gather(*self.handoff._tasks)

    def decode_to_end(self):
        while self.d.policy.has_work():
            run_step(self.d.policy, self.d_worker)
        while self.p.policy.has_work():  # the release of what moved
            run_step(self.p.policy, self.p_worker)


def colocated(seq_id: int, **kwargs) -> list[int]:
    policy, worker = engine("both", 100, None).policy, FakeWorker()
    worker.policy = policy
    seq = make_seq(seq_id, **kwargs)
    policy.add(seq)
    while policy.has_work():
        run_step(policy, worker)
    return seq.output_token_ids


@pytest.mark.parametrize("failures, outcome", [(0, "sent"), (1, "retried"), (2, "recomputed")])
def test_the_sequence_decodes_on_the_decode_worker_as_it_would_have_in_place(failures, outcome):
    async def scenario():
        pair = Pair(failures)
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        stream = pair.prefill(seq)
        await pair.settle()
        assert pair.client.calls == min(failures + 1, 2)
        assert pair.d.delivers(seq.request_id) and not pair.p.delivers(seq.request_id)
        # Computed there: the prompt, or (recomputed) nothing the decode pool did not hold.
        assert seq.num_computed_tokens == (0 if outcome == "recomputed" else 10)
        pair.decode_to_end()
        assert seq.output_token_ids == colocated(1, prompt_len=10, max_tokens=8)
        assert seq.status is SequenceStatus.FINISHED
        assert pair.p.policy.num_free_blocks == pair.d.policy.num_free_blocks == 100
        assert 1 in pair.p_worker.released  # the prefill worker forgot it
        assert stream.get_nowait()[1].token_id == seq.output_token_ids[0]  # the first token came from there

    asyncio.run(scenario())


def test_the_decode_pools_prefix_hit_is_not_sent_again():
    async def scenario():
        pair = Pair()
        first = make_seq(1, prompt_len=10, max_tokens=3)
        pair.prefill(first)
        await pair.settle()
        pair.decode_to_end()
        again = make_seq(2, prompt_len=10, max_tokens=3)
        pair.client.calls = 0
        pair.prefill(again)
        await pair.settle()
        # 10 tokens: blocks 0 and 1 are full and cached on the decode worker; block 2 moves.
        assert again.num_computed_tokens == 10 and pair.d.policy.num_cached_tokens == 8
        pair.decode_to_end()
        assert again.output_token_ids == colocated(2, prompt_len=10, max_tokens=3)

    asyncio.run(scenario())


def test_an_abort_while_its_kv_moves_frees_both_sides():
    async def scenario():
        pair = Pair()
        pair.client.hold = asyncio.Event()
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        pair.prefill(seq)
        await asyncio.sleep(0.01)  # reserved on the decode worker, sending
        assert pair.d.policy.num_free_blocks < 100 and pair.p.policy.num_unfinished == 1
        pair.p.policy.finish(seq, FinishReason.ABORT)
        pair.client.hold.set()
        await pair.settle()
        assert not pair.d.policy.has_work() and pair.d.policy.num_free_blocks == 100
        pair.decode_to_end()
        assert pair.p.policy.num_free_blocks == 100 and 1 in pair.p_worker.released

    asyncio.run(scenario())


def test_without_room_on_a_decode_worker_it_decodes_where_it_was_prefilled(monkeypatch):
    monkeypatch.setattr(handoff_module, "ROOM_WAIT_S", 0.05)

    async def scenario():
        pair = Pair(decode_blocks=2)  # 10 tokens need 3 blocks
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        pair.prefill(seq)
        await pair.settle()
        assert pair.client.calls == 0 and not seq.moves and pair.p.delivers(seq.request_id)
        while pair.p.policy.has_work():
            run_step(pair.p.policy, pair.p_worker)
        assert seq.output_token_ids == colocated(1, prompt_len=10, max_tokens=8)

    asyncio.run(scenario())


@pytest.mark.parametrize("lost", ["decode", "prefill"])
def test_a_worker_lost_while_its_kv_moves_leaves_it_to_the_other(lost):
    async def scenario():
        pair = Pair()
        pair.client.hold = asyncio.Event()
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        pair.prefill(seq)
        await asyncio.sleep(0.01)
        gone = pair.d if lost == "decode" else pair.p
        gone._new_policy(gone.policy.capacity)  # it came back empty
        pair.client.hold.set()
        await pair.settle()
        other, worker = (pair.p, pair.p_worker) if lost == "decode" else (pair.d, pair.d_worker)
        assert other.delivers(seq.request_id) and not seq.moves
        while other.policy.has_work():
            run_step(other.policy, worker)
        assert seq.output_token_ids == colocated(1, prompt_len=10, max_tokens=8)

    asyncio.run(scenario())


def test_a_draining_prefill_worker_sends_what_it_holds_and_then_holds_nothing():
    async def scenario():
        pair = Pair()
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        pair.prefill(seq)
        pair.p.is_draining = True  # SIGTERM came: no new sequences, but its transfers go on
        assert pair.p.load == 1  # what keeps a draining worker up
        await pair.settle()
        assert pair.d.delivers(seq.request_id)
        plan = pair.p.policy.schedule()  # the release that lets the worker's drain end
        assert plan is not None and plan.release_seq_ids == [1] and not plan.scheduled
        assert pair.p.load == 0

    asyncio.run(scenario())


def test_a_received_sequence_is_planned_ahead_as_any_decode():
    async def scenario():
        pair = Pair()
        seq = make_seq(1, prompt_len=10, max_tokens=8)
        pair.prefill(seq)
        await pair.settle()
        policy = pair.d.policy
        first = policy.schedule()  # feeds the first token
        ahead = policy.schedule()  # planned while the first runs
        assert [e.seq for e in first.scheduled] == [seq] and not first.scheduled[0].feeds_last_sampled
        assert [e.seq for e in ahead.scheduled] == [seq] and ahead.scheduled[0].feeds_last_sampled

    asyncio.run(scenario())
