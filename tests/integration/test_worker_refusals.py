"""The blast radius of one request, in process over real gRPC: the scheduler's
SchedulerService, its engine and WorkerClient, and a WorkerService on the real
bundled model (CPU, float32). A request the worker cannot serve (top_logprobs
1000, temperature NaN) fails alone with INVALID_ARGUMENT naming the field while
the requests beside it run to their end; a step the worker refuses whole ends
the requests in it, but the worker stays ready. There is no health poll after
start, so nothing but the engine itself can keep the worker ready."""
from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import NO_WORKER_READY, STEP_FAILED, WORKER_LOST, ErrorInterceptor, invalid_argument
from services.common.model_files import default_model_path, resolve_model
from services.scheduler import engine as engine_module
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import EngineLoop
from services.scheduler.router import Router
from services.scheduler.server import SchedulerServicer
from services.scheduler.worker_client import WorkerClient
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.server import WorkerServicer
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from stormserve.worker.v1 import worker_pb2_grpc

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(resolve_model(default_model_path()), select_platform("cpu"), dtype="float32", block_size=16,
                       kv_cache_bytes=64 * 2**20, max_batch_size=16)


@pytest.fixture(autouse=True)
def no_health_poll_after_start(monkeypatch):
    monkeypatch.setattr(engine_module, "HEALTH_POLL_S", 3600.0)


@asynccontextmanager
async def serving(runner: ModelRunner):
    """A worker and a scheduler driving it, on ports 0; yields (scheduler stub, engine)."""
    worker = grpc.aio.server(interceptors=[ErrorInterceptor()])
    servicer = WorkerServicer(runner)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, worker)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, worker)
    worker_port = worker.add_insecure_port("127.0.0.1:0")
    await worker.start()
    engine = EngineLoop(WorkerClient(f"127.0.0.1:{worker_port}"), max_batch_size=8, max_prefill_tokens=256)
    scheduler = grpc.aio.server(interceptors=[ErrorInterceptor()])
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(SchedulerConfig(), Router([engine])),
                                                              scheduler)
    scheduler_port = scheduler.add_insecure_port("127.0.0.1:0")
    await scheduler.start()
    engine.start()
    try:
        for _ in range(500):
            if engine.is_ready:
                break
            await asyncio.sleep(0.01)
        assert engine.is_ready
        async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}") as chan:
            yield scheduler_pb2_grpc.SchedulerServiceStub(chan), engine
    finally:
        await engine.stop()
        await scheduler.stop(None)
        await worker.stop(None)
        servicer.close()


def request(request_id: str, prompt_start: int, **sampling) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=list(range(prompt_start, prompt_start + 20)),
        sampling=scheduler_pb2.SamplingParams(**{"temperature": 0.0, **sampling}),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))


async def run(stub, message) -> tuple[list[int], int] | grpc.aio.AioRpcError:
    """(tokens, finish reason) of a one-choice request, or the error it ended with."""
    tokens, finish = [], 0
    try:
        async for reply in stub.Generate(message, timeout=120):
            tokens += [t.token_id for t in reply.tokens]
            finish = reply.finish_reason or finish
    except grpc.aio.AioRpcError as exc:
        return exc
    return tokens, finish


async def started_streams(stub, engine: EngineLoop, count: int) -> list[asyncio.Task]:
    """`count` ordinary requests, running (each has had its prefill) when this returns."""
    tasks = [asyncio.create_task(run(stub, request(f"ok-{i}", 1000 + 100 * i))) for i in range(count)]
    for _ in range(2000):
        if engine.policy is not None and len(engine.policy.running) == count and engine.num_steps >= 2:
            return tasks
        await asyncio.sleep(0.005)
    raise AssertionError("the ordinary requests did not start")


@pytest.mark.parametrize("sampling, n, field", [
    ({"top_logprobs": 1000}, 1, "top_logprobs"),
    ({"temperature": math.nan}, 1, "temperature"),
    ({"top_logprobs": 1000}, 3, "top_logprobs"),
], ids=["top_logprobs", "temperature NaN", "n=3"])
def test_a_request_the_worker_cannot_serve_fails_alone(runner: ModelRunner, sampling, n, field):
    async def scenario():
        async with serving(runner) as (stub, engine):
            streams = await started_streams(stub, engine, 4)
            bad = request("bad", 5000, **sampling)
            bad.n = n
            failure = await run(stub, bad)
            ready = engine.is_ready
            results = await asyncio.gather(*streams)
            after = await run(stub, request("after", 7000))
            for _ in range(200):  # the last releases go out with a step of their own
                if not runner.sequences:
                    break
                await asyncio.sleep(0.01)
            return failure, ready, results, after

    failure, ready, results, after = asyncio.run(scenario())
    assert isinstance(failure, grpc.aio.AioRpcError)
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and field in failure.details()
    assert "seq" not in failure.details() and "127.0.0.1" not in failure.details()
    assert ready
    for result in results + [after]:
        assert not isinstance(result, grpc.aio.AioRpcError), result
        assert len(result[0]) == MAX_TOKENS and result[1] == scheduler_pb2.FINISH_REASON_LENGTH
    assert not runner.sequences  # nothing kept of the refused sequences, nothing leaked


def test_a_step_refused_whole_ends_its_requests_and_the_worker_stays_ready(runner: ModelRunner, monkeypatch):
    step = runner.step
    calls = {"refuse": False}

    def step_or_refuse(*args, **kwargs):
        if calls["refuse"]:
            calls["refuse"] = False
            raise invalid_argument("seq 1 appears twice in one step")  # as a scheduler bug would make it
        return step(*args, **kwargs)

    monkeypatch.setattr(runner, "step", step_or_refuse)

    async def scenario():
        async with serving(runner) as (stub, engine):
            streams = await started_streams(stub, engine, 2)
            calls["refuse"] = True
            failures = await asyncio.gather(*streams)
            ready = engine.is_ready
            after = await run(stub, request("after", 7000))
            return failures, ready, after

    failures, ready, after = asyncio.run(scenario())
    for failure in failures:
        assert isinstance(failure, grpc.aio.AioRpcError)
        assert failure.code() == grpc.StatusCode.UNAVAILABLE and failure.details() == STEP_FAILED
    assert ready
    assert not isinstance(after, grpc.aio.AioRpcError) and len(after[0]) == MAX_TOKENS


def test_a_step_that_fails_inside_the_worker_still_takes_it_out_of_service(runner: ModelRunner, monkeypatch):
    """INTERNAL (an exception in the step, as a collective that lost a tensor-parallel
    rank raises) leaves the worker in doubt: lost, until a health poll brings it back."""
    step = runner.step

    def step_or_fail(*args, **kwargs):
        if args[0]:  # a step with sequences
            raise RuntimeError("the device is gone")
        return step(*args, **kwargs)

    monkeypatch.setattr(runner, "step", step_or_fail)

    async def scenario():
        async with serving(runner) as (stub, engine):
            failure = await run(stub, request("doomed", 1000))
            return failure, engine.is_ready, await run(stub, request("after", 7000))

    failure, ready, after = asyncio.run(scenario())
    assert failure.code() == grpc.StatusCode.UNAVAILABLE and failure.details() == WORKER_LOST
    assert not ready
    assert after.code() == grpc.StatusCode.UNAVAILABLE and after.details() == NO_WORKER_READY
