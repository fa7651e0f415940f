"""The worker's step channel (services/worker/step_channel.py) on the real model:
StepStream's messages as frames, answered in order; a failed step answered
with its status; the stream's sequences forgotten when the connection ends;
the drain's refusal and timeout as a last frame. And the scheduler's
WorkerClient on it, falling back to StepStream where it cannot be reached."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from services.common.frames import read_frame, write_frame
from services.common.grpc_server import GrpcService
from services.scheduler.policy import BatchPolicy
from services.scheduler.sequence import SamplingParams, Sequence, StoppingCriteria
from services.scheduler.worker_client import WorkerClient, _StepChannel
from services.worker.model_runner import ModelRunner
from services.worker.server import WorkerServicer
from services.worker.step_channel import serve_step_channel
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc


def _sampling() -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=1, repetition_penalty=1.0,
                                     top_logprobs=-1)


def _prefill(seq_id: int, block_table=(0, 1)) -> worker_pb2.StepStreamRequest:
    return worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=1, sequences=[worker_pb2.SequenceStep(
        seq_id=seq_id, token_ids=[10, 11, 12, 13, 14], sample=True, sampling=_sampling(),
        block_table=list(block_table))]))


async def _worker(runner: ModelRunner, scenario, drain_timeout_s: float = 30):
    """A worker as __main__ runs one: gRPC on port 0 and its step channel; `scenario(service, servicer)`."""
    service = GrpcService("worker", "127.0.0.1", 0, drain_timeout_s)
    servicer = WorkerServicer(drain=service.drain)
    steps = await serve_step_channel(servicer, "127.0.0.1", 0, None)
    servicer.attach(runner)
    service.add(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer,
                worker_pb2.DESCRIPTOR.services_by_name["WorkerService"])
    await service.start()
    await service.set_serving(True)
    try:
        return await scenario(service, servicer)
    finally:
        steps.close()
        await service.server.stop(None)


async def _answer(reader: asyncio.StreamReader) -> worker_pb2.StepStreamResponse | None:
    frame = await asyncio.wait_for(read_frame(reader), 60)
    return None if frame is None else worker_pb2.StepStreamResponse.FromString(frame)


def test_steps_sent_ahead_come_back_in_order_with_the_tokens_of_grpc(runner: ModelRunner):
    async def scenario(service, servicer):
        reader, writer = await asyncio.open_connection("127.0.0.1", servicer.step_port)
        write_frame(writer, _prefill(921))
        write_frame(writer, worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=2, decode_seq_ids=[921],
                                                                                     decode_new_blocks=[-1])))
        write_frame(writer, worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=3,
                                                                                     release_seq_ids=[921])))
        answers = [await _answer(reader) for _ in range(3)]
        writer.close()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
            stream = worker_pb2_grpc.WorkerServiceStub(channel).StepStream()
            for request in (_prefill(922), worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
                    step_id=2, decode_seq_ids=[922], decode_new_blocks=[-1]))):
                await stream.write(request)
            on_grpc = [await stream.read() for _ in range(2)]
            await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=3,
                                                                                        release_seq_ids=[922])))
            await stream.read()
            await stream.done_writing()
        return answers, on_grpc

    answers, on_grpc = asyncio.run(_worker(runner, scenario))
    assert [a.step.step_id for a in answers] == [1, 2, 3]
    assert [a.step.tokens[0].token_id for a in answers[:2]] == [a.step.tokens[0].token_id for a in on_grpc]
    assert 921 not in runner.sequences and 922 not in runner.sequences


def test_a_failed_step_is_answered_with_its_status_and_an_ended_connection_forgets_the_sequences(
        runner: ModelRunner):
    async def scenario(service, servicer):
        reader, writer = await asyncio.open_connection("127.0.0.1", servicer.step_port)
        write_frame(writer, _prefill(923))
        held = await _answer(reader)
        write_frame(writer, _prefill(924, block_table=[10**6, 10**6 + 1]))  # blocks outside the pool
        write_frame(writer, _prefill(925))
        failed = await _answer(reader)
        writer.close()  # the scheduler goes: 923 is forgotten, 925 never ran
        for _ in range(500):
            if 923 not in runner.sequences:
                break
            await asyncio.sleep(0.01)
        return held, failed

    held, failed = asyncio.run(_worker(runner, scenario))
    assert len(held.step.tokens) == 1
    assert failed.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "block id outside" in failed.error.message
    assert not {923, 924, 925} & set(runner.sequences)


def test_a_draining_worker_refuses_a_new_channel_and_ends_an_open_one_at_its_timeout(runner: ModelRunner):
    async def scenario(service, servicer):
        reader, writer = await asyncio.open_connection("127.0.0.1", servicer.step_port)
        write_frame(writer, _prefill(926))
        await _answer(reader)
        service.request_stop()
        stopping = asyncio.create_task(service.serve_forever(servicer.is_idle, 0.2))
        while not service.drain.draining:
            await asyncio.sleep(0.01)
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", servicer.step_port)
        write_frame(late_writer, _prefill(927))
        refused = await _answer(late_reader)
        assert await _answer(late_reader) is None  # then the worker's end of the connection
        late_writer.close()
        assert await asyncio.wait_for(stopping, 5) is False  # 926 is still held at the timeout
        ended = await _answer(reader)
        writer.close()
        return refused, ended

    refused, ended = asyncio.run(_worker(runner, scenario, drain_timeout_s=0.5))
    assert refused.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert ended.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "its drain timeout (0.5 s) passed" in ended.error.message
    assert 927 not in runner.sequences
    runner.step([], [926], [])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("reachable", [True, False])
def test_the_scheduler_sends_steps_on_the_channel_or_on_step_stream_where_it_cannot_reach_it(
        runner: ModelRunner, reachable: bool, caplog):
    async def scenario(service, servicer):
        if not reachable:  # Describe reports a port nothing listens on (a network policy without it)
            servicer.step_port = _closed_port()
            servicer.attach(runner)
        client = WorkerClient(f"127.0.0.1:{service.port}")
        capacity, _ = await client.describe()
        policy = BatchPolicy(capacity, 8, 512)
        seq = Sequence(931, "r", [10, 11, 12, 13, 14], SamplingParams(temperature=0.0), StoppingCriteria(max_tokens=4),
                       0)
        policy.add(seq)
        while (plan := policy.schedule()) is not None:  # one step at a time, the whole way
            await client.send(plan)
            answer = await client.receive()
            policy.postprocess(plan, answer.tokens, 0, 0)
        on_channel = isinstance(client._steps, _StepChannel)
        await client.close()
        return seq.output_token_ids, on_channel

    tokens, on_channel = asyncio.run(_worker(runner, scenario))
    assert len(tokens) == 4 and on_channel is reachable
    assert ("cannot be reached" in caplog.text) is not reachable
