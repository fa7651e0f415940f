"""WorkerService over real gRPC (in-process server on port 0): conversion,
status codes, the not-yet-loaded state, and the drain on SIGTERM."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.errors import ErrorInterceptor
from services.common.grpc_server import GrpcService, health_status
from services.worker.model_runner import ModelRunner
from services.worker.server import WorkerServicer
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc


async def _with_server(servicer: WorkerServicer, calls):
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            return await calls(worker_pb2_grpc.WorkerServiceStub(chan))
    finally:
        await server.stop(None)


def _sampling(**overrides) -> worker_pb2.SamplingParams:
    values = dict(temperature=0.0, top_k=0, top_p=1.0, seed=1, repetition_penalty=1.0, top_logprobs=-1)
    values.update(overrides)
    return worker_pb2.SamplingParams(**values)


def test_describe_and_steps_over_grpc(runner: ModelRunner):
    async def calls(stub):
        info = await stub.Describe(worker_pb2.DescribeRequest())
        first = await stub.Step(worker_pb2.StepRequest(step_id=1, sequences=[
            worker_pb2.SequenceStep(
                seq_id=701, token_ids=[10, 11, 12], sample=True, sampling=_sampling(top_logprobs=3),
                block_table=[0],
            ),
            worker_pb2.SequenceStep(seq_id=702, token_ids=[20, 21], sample=False, sampling=_sampling(),
                                    block_table=[1]),
        ]))
        token = first.tokens[0].token_id
        second = await stub.Step(worker_pb2.StepRequest(step_id=2, release_seq_ids=[702], sequences=[
            worker_pb2.SequenceStep(seq_id=701, token_ids=[token], num_computed_tokens=3, sample=True,
                                    block_table=[0]),
        ]))
        await stub.Step(worker_pb2.StepRequest(step_id=3, release_seq_ids=[701]))
        return info, first, second

    info, first, second = asyncio.run(_with_server(WorkerServicer(runner), calls))
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    assert info.num_kv_blocks == runner.kv_pool.num_blocks and info.block_size == 4
    assert not info.sampling_defaults.HasField("temperature")  # the model defines none
    assert [t.seq_id for t in first.tokens] == [701]  # 702 was a prefill chunk without sampling
    assert first.tokens[0].HasField("logprob") and len(first.tokens[0].top_logprobs) == 3
    assert first.step_id == 1 and first.execute_time_us > 0
    assert second.tokens[0].seq_id == 701
    assert second.tokens[0].HasField("logprob")  # sampling params kept from the first step
    assert not {701, 702} & set(runner.sequences)


@pytest.mark.parametrize(
    "sequence, code",
    [
        (worker_pb2.SequenceStep(seq_id=801, token_ids=[1], sample=True, sampling=_sampling()),
         grpc.StatusCode.INVALID_ARGUMENT),  # no block table
        (worker_pb2.SequenceStep(seq_id=801, token_ids=[1] * 9, sample=True, sampling=_sampling(), block_table=[0]),
         grpc.StatusCode.INVALID_ARGUMENT),  # a block table too short
        (worker_pb2.SequenceStep(seq_id=801, sample=True, sampling=_sampling(), block_table=[0]),
         grpc.StatusCode.INVALID_ARGUMENT),  # nothing to feed
    ],
)
def test_bad_steps_map_to_status_codes(runner: ModelRunner, sequence, code):
    """Steps that contradict the worker's state are refused whole; what one
    request asks is refused per sequence (test_refusals.py)."""
    async def calls(stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(worker_pb2.StepRequest(step_id=1, sequences=[sequence]))
        return info.value.code()

    assert asyncio.run(_with_server(WorkerServicer(runner), calls)) == code


def test_unavailable_until_the_model_is_loaded():
    async def calls(stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Describe(worker_pb2.DescribeRequest())
        return info.value.code()

    assert asyncio.run(_with_server(WorkerServicer(), calls)) == grpc.StatusCode.UNAVAILABLE


def test_step_stream_runs_steps_sent_ahead_in_order(runner: ModelRunner):
    """Step 2 is sent before step 1's answer and feeds the token step 1 samples;
    the answers come back in order and match the same steps run one by one."""
    prompt = [10, 11, 12, 13, 14]

    def first(seq_id):
        return worker_pb2.StepRequest(step_id=1, sequences=[worker_pb2.SequenceStep(
            seq_id=seq_id, token_ids=prompt, sample=True, sampling=_sampling(top_logprobs=0), block_table=[0, 1])])

    async def calls(stub):
        # One by one, with the token known.
        one = await stub.Step(first(901))
        two = await stub.Step(worker_pb2.StepRequest(step_id=2, sequences=[
            worker_pb2.SequenceStep(seq_id=901, token_ids=[one.tokens[0].token_id], num_computed_tokens=5,
                                    sample=True, block_table=[0, 1])]))
        await stub.Step(worker_pb2.StepRequest(step_id=3, release_seq_ids=[901]))
        # Ahead, on one stream: both sent before either answer is read.
        stream = stub.StepStream()
        await stream.write(worker_pb2.StepStreamRequest(step=first(902)))
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
            step_id=2, sequences=[worker_pb2.SequenceStep(
                seq_id=902, num_computed_tokens=5, sample=True, block_table=[0, 1], feed_last_sampled=True)])))
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=3, release_seq_ids=[902])))
        await stream.done_writing()
        answers = [reply.step async for reply in stream]
        return (one, two), answers

    (one, two), answers = asyncio.run(_with_server(WorkerServicer(runner), calls))
    assert [a.step_id for a in answers] == [1, 2, 3]
    assert [a.tokens[0].token_id for a in answers[:2]] == [one.tokens[0].token_id, two.tokens[0].token_id]
    assert answers[1].tokens[0].logprob == pytest.approx(two.tokens[0].logprob, abs=1e-5)
    assert 902 not in runner.sequences


def test_a_failed_step_is_answered_in_the_stream_and_nothing_after_it_runs(runner: ModelRunner):
    """The failed step's answer carries its status; the step sent after it (and
    one sent after that answer) is not run, and the stream ends when the caller
    ends it, without an error of its own (worker.proto, StepStreamResponse.error)."""
    async def calls(stub):
        stream = stub.StepStream()
        bad = worker_pb2.SequenceStep(seq_id=903, token_ids=[1, 2], sample=True, sampling=_sampling(),
                                      block_table=[10**6])  # a block outside the pool
        after = worker_pb2.SequenceStep(seq_id=904, token_ids=[1, 2], sample=True, sampling=_sampling(),
                                        block_table=[1])
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=1, sequences=[bad])))
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=2, sequences=[after])))
        answer = await stream.read()
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=3, sequences=[after])))
        await stream.done_writing()
        return answer, await stream.read(), await stream.code()

    answer, end, code = asyncio.run(_with_server(WorkerServicer(runner), calls))
    assert not answer.HasField("step")
    assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "block id outside" in answer.error.message
    assert end is grpc.aio.EOF and code == grpc.StatusCode.OK
    assert 904 not in runner.sequences


def test_the_sequences_a_step_stream_leaves_are_forgotten_when_it_ends(runner: ModelRunner):
    """A scheduler restarted numbers its sequences from 1 again: a sequence it
    starts must not meet what the worker kept of the old scheduler's."""
    def prefill(seq_id: int) -> worker_pb2.StepRequest:
        return worker_pb2.StepRequest(step_id=1, sequences=[worker_pb2.SequenceStep(
            seq_id=seq_id, token_ids=[10, 11, 12], sample=True, sampling=_sampling(), block_table=[0])])

    async def calls(stub):
        stream = stub.StepStream()  # the old scheduler: starts 905, 906, releases 906, then goes
        await stream.write(worker_pb2.StepStreamRequest(step=prefill(905)))
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
            step_id=2, release_seq_ids=[905], sequences=prefill(906).sequences)))
        await stream.done_writing()
        assert [reply.step.step_id async for reply in stream] == [1, 2]
        return await stub.Step(prefill(906))  # the new one starts its own 906 from scratch

    fresh = asyncio.run(_with_server(WorkerServicer(runner), calls))
    assert [t.seq_id for t in fresh.tokens] == [906] and 905 not in runner.sequences
    runner.release(906)


async def _draining_worker(runner: ModelRunner, drain_timeout_s: float, settle_s: float, scenario):
    """WorkerServicer in a GrpcService on port 0, as __main__ runs it; `scenario(service, stub)`."""
    service = GrpcService("worker", "127.0.0.1", 0, drain_timeout_s)
    servicer = WorkerServicer(runner, drain=service.drain)
    service.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer,
                worker_pb2.DESCRIPTOR.services_by_name["WorkerService"])
    await service.start()
    await service.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as chan:
            stopped = lambda: service.serve_forever(servicer.is_idle, settle_s)  # noqa: E731
            return await scenario(service, chan, worker_pb2_grpc.WorkerServiceStub(chan), stopped)
    finally:
        await service.server.stop(None)


def _prefill(seq_id: int) -> worker_pb2.StepStreamRequest:
    return worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=1, sequences=[worker_pb2.SequenceStep(
        seq_id=seq_id, token_ids=[10, 11, 12], sample=True, sampling=_sampling(), block_table=[0, 1])]))


def test_a_draining_worker_runs_steps_until_its_sequences_are_released_then_stops(runner: ModelRunner):
    async def scenario(service, chan, stub, serve_forever):
        stream = stub.StepStream()
        await stream.write(_prefill(911))
        token = (await stream.read()).step.tokens[0].token_id
        began = time.monotonic()
        service.request_stop()
        stopping = asyncio.create_task(serve_forever())
        while not service.drain.draining:
            await asyncio.sleep(0.01)
        assert await health_status(chan) == health_pb2.HealthCheckResponse.NOT_SERVING  # draining, not gone
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.StepStream().read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(0.5)
        assert not stopping.done()  # 911 is still held
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=2, sequences=[
            worker_pb2.SequenceStep(seq_id=911, token_ids=[token], num_computed_tokens=3, sample=True,
                                    block_table=[0, 1])])))
        assert len((await stream.read()).step.tokens) == 1  # still runs steps
        await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=3, release_seq_ids=[911])))
        await stream.read()
        assert await asyncio.wait_for(stopping, 5) is True
        return time.monotonic() - began

    took = asyncio.run(_draining_worker(runner, drain_timeout_s=30, settle_s=0.2, scenario=scenario))
    assert 0.5 < took < 3
    assert 911 not in runner.sequences


def test_a_worker_whose_drain_times_out_ends_its_step_stream_with_the_reason(runner: ModelRunner):
    async def scenario(service, chan, stub, serve_forever):
        stream = stub.StepStream()
        await stream.write(_prefill(912))
        await stream.read()
        service.request_stop()
        assert await asyncio.wait_for(serve_forever(), 5) is False
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await stream.read()
        return ended.value

    error = asyncio.run(_draining_worker(runner, drain_timeout_s=0.3, settle_s=0.2, scenario=scenario))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker shut down before this request finished: its drain timeout (0.3 s) passed" in error.details()
    runner.step([], [912], [])
