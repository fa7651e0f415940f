"""EngineLoop and a draining worker (one that answers health NOT_SERVING after it
was ready): no new sequences go there, the running ones run to their end, and
it leaves without failing anything; only a worker that stops answering (or
whose step stream breaks) ends its sequences with an error."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.common.errors import WORKER_LOST
from services.scheduler.engine import EngineLoop, SequenceFailed
from services.scheduler.plan import StepAnswer
from services.scheduler.router import Router
from services.scheduler.worker_client import WorkerError, WorkerHealth
from tests.unit.scheduler.test_policy import BLOCK_SIZE, EOS, FakeWorker, WorkerCapacity, make_seq
from tests.unit.scheduler.streams import submit

STEP_S = 0.005


class FakeWorkerClient:
    """WorkerClient over test_policy's FakeWorker: steps answered in order, each after STEP_S."""

    def __init__(self, address: str = "w0"):
        self.address = address
        self.state = WorkerHealth.SERVING
        self.fake = FakeWorker(token=7)
        self.answers: asyncio.Queue = asyncio.Queue()
        self.fail_with: str | None = None  # the step stream breaks with this

    async def health(self) -> WorkerHealth:
        return self.state

    async def describe(self):
        capacity = WorkerCapacity(num_kv_blocks=64, block_size=BLOCK_SIZE, max_batch_size=8,
                                  eos_token_ids=frozenset({EOS}))
        return capacity, SimpleNamespace(model_path="fake")

    async def send(self, plan) -> None:
        if self.fail_with is not None:
            raise WorkerError(self.fail_with)
        self.answers.put_nowait(StepAnswer(self.fake.step(plan)))

    async def receive(self):
        await asyncio.sleep(STEP_S)
        if self.fail_with is not None:
            raise WorkerError(self.fail_with)
        return self.answers.get_nowait()

    def reset(self) -> None:
        self.answers = asyncio.Queue()

    async def close(self) -> None:
        pass


async def started_engine(address: str = "w0") -> tuple[EngineLoop, FakeWorkerClient]:
    client = FakeWorkerClient(address)
    engine = EngineLoop(client, max_batch_size=8, max_prefill_tokens=64)  # type: ignore[arg-type]
    engine.start()
    for _ in range(100):
        if engine.is_ready:
            break
        await asyncio.sleep(0.01)
    assert engine.is_ready
    return engine, client


async def tokens_until_end(stream, max_tokens: int) -> list:
    """What the stream delivers until `max_tokens` tokens or a failure."""
    items = []
    while len(items) < max_tokens:
        item = await asyncio.wait_for(stream.get(), 5)
        if item is None:
            continue
        items.append(item)
        if isinstance(item, SequenceFailed):
            break
    return items


async def set_health(engine: EngineLoop, client: FakeWorkerClient, health: WorkerHealth) -> None:
    client.state = health  # the next poll agrees
    await engine.on_health(health)


def test_a_draining_worker_runs_its_sequences_to_the_end_and_takes_no_new_one() -> None:
    async def scenario() -> None:
        draining, client = await started_engine("w0")
        other, _ = await started_engine("w1")
        router = Router([draining, other])
        seq = make_seq(1, prompt_len=6, max_tokens=30)
        stream = submit(draining, [seq])
        first = await asyncio.wait_for(stream.get(), 5)
        assert isinstance(first, tuple)

        await set_health(draining, client, WorkerHealth.NOT_SERVING)
        assert draining.is_draining and draining.is_ready and not draining.accepts_sequences
        assert router.ready_engines == [other]
        assert router.place([make_seq(2, prompt_len=6)]) is other

        rest = await tokens_until_end(stream, 29)
        assert all(isinstance(item, tuple) for item in rest) and len(rest) == 29
        assert rest[-1][0].is_finished
        for _ in range(100):  # the release goes out with the next step
            if 1 in client.fake.released:
                break
            await asyncio.sleep(0.01)
        assert 1 in client.fake.released and draining.load == 0

        # It exits: no longer answering, with nothing left on it, is not a failure.
        await set_health(draining, client, WorkerHealth.DOWN)
        assert not draining.is_ready and stream.empty()
        for engine in (draining, other):
            await engine.stop()

    asyncio.run(scenario())


def test_a_draining_worker_whose_step_stream_breaks_fails_its_sequences_with_the_reason() -> None:
    async def scenario() -> None:
        engine, client = await started_engine()
        stream = submit(engine, [make_seq(1, prompt_len=6, max_tokens=200)])
        assert isinstance(await asyncio.wait_for(stream.get(), 5), tuple)
        await set_health(engine, client, WorkerHealth.NOT_SERVING)
        client.fail_with = "worker w0: UNAVAILABLE: worker shut down before this request finished: " \
                           "its drain timeout (30 s) passed"
        items = await tokens_until_end(stream, 200)
        assert isinstance(items[-1], SequenceFailed)
        assert items[-1].message == WORKER_LOST  # the reason (the drain timeout) is in the log
        assert not engine.is_ready
        await engine.stop()

    asyncio.run(scenario())


def test_a_worker_gone_with_sequences_on_it_fails_them_draining_or_not() -> None:
    async def scenario() -> None:
        for drain_first in (False, True):
            engine, client = await started_engine()
            stream = submit(engine, [make_seq(1, prompt_len=6, max_tokens=200)])
            assert isinstance(await asyncio.wait_for(stream.get(), 5), tuple)
            if drain_first:
                await set_health(engine, client, WorkerHealth.NOT_SERVING)
            await set_health(engine, client, WorkerHealth.DOWN)
            items = await tokens_until_end(stream, 200)
            assert isinstance(items[-1], SequenceFailed) and items[-1].message == WORKER_LOST
            await engine.stop()

    asyncio.run(scenario())


def test_a_draining_worker_that_serves_again_takes_new_sequences() -> None:
    async def scenario() -> None:
        engine, client = await started_engine()
        await set_health(engine, client, WorkerHealth.NOT_SERVING)
        assert not engine.accepts_sequences
        await set_health(engine, client, WorkerHealth.SERVING)
        assert engine.accepts_sequences and not engine.is_draining
        await engine.stop()

    asyncio.run(scenario())
