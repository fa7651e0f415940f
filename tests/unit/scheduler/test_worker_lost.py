"""A worker lost mid-request: its requests end with a message that names no
worker, and the scheduler's log names it, one line per request id."""
from __future__ import annotations

import asyncio

from services.scheduler.engine import WORKER_LOST, EngineLoop, SequenceFailed
from services.scheduler.plan import WorkerCapacity
from services.scheduler.worker_client import WorkerError, WorkerHealth
from tests.unit.scheduler.test_policy import make_seq
from tests.unit.scheduler.streams import submit

ADDRESS = "127.0.0.1:50999"


class DyingWorker:
    """Takes steps, then fails the first answer as WorkerClient does when the worker dies."""

    address = ADDRESS

    def __init__(self):
        self.sent = 0

    async def health(self) -> WorkerHealth:
        return WorkerHealth.SERVING

    async def describe(self):
        capacity = WorkerCapacity(num_kv_blocks=64, block_size=4, max_batch_size=8, eos_token_ids=frozenset({2}))
        return capacity, type("Info", (), {"model_path": "/models/m"})()

    async def send(self, plan) -> None:
        self.sent += 1

    async def receive(self):
        raise WorkerError(f"worker {ADDRESS}: UNAVAILABLE: Socket closed")

    def reset(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_a_lost_worker_fails_its_requests_without_naming_itself(caplog):
    async def scenario():
        engine = EngineLoop(DyingWorker(), max_batch_size=8, max_prefill_tokens=64)
        engine.start()
        try:
            while not engine.is_ready:
                await asyncio.sleep(0.01)
            streams = [submit(engine, [make_seq(i)]) for i in (1, 2)]
            return [await asyncio.wait_for(s.get(), 10) for s in streams]
        finally:
            await engine.stop()

    failures = asyncio.run(scenario())
    assert failures == [SequenceFailed(WORKER_LOST)] * 2
    assert ADDRESS not in WORKER_LOST
    logged = [r.getMessage() for r in caplog.records if WORKER_LOST in r.getMessage()]
    assert sorted(line.split(":")[0] for line in logged) == ["r1", "r2"]
    assert all(ADDRESS in line and "Socket closed" in line for line in logged)
