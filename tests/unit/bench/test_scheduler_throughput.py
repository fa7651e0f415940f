"""bench.scheduler_throughput: its simulated workers answer a step as a worker
would (one token per sampling sequence, in order, the step id echoed), and a
tiny point (1 worker, 8 sequences) runs the real scheduler process end to end."""
from __future__ import annotations

import asyncio

from bench.scheduler_throughput import TOKEN_ID, Point, SimulatedWorkers, ab_summary, parse_args, run_point, table
from stormserve.worker.v1 import worker_pb2


def step(step_id: int, sampling: list[tuple[int, bool]]) -> bytes:
    request = worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
        step_id=step_id, sequences=[worker_pb2.SequenceStep(seq_id=i, sample=s, block_table=[i]) for i, s in sampling]))
    return request.SerializeToString()


def test_a_simulated_step_answers_every_sampling_sequence_in_order():
    workers = SimulatedWorkers(1, block_size=16, num_kv_blocks=64, max_batch_size=8)
    for step_id in (7, 8):  # the second answer comes from the cache, with its own step id
        reply = worker_pb2.StepStreamResponse.FromString(workers.answer(step(step_id, [(3, True), (1, False), (2, True)])))
        assert reply.step.step_id == step_id
        assert [(t.seq_id, t.token_id) for t in reply.step.tokens] == [(3, TOKEN_ID), (2, TOKEN_ID)]
        assert not reply.HasField("error")
    assert (workers.num_steps, workers.num_tokens) == (2, 4)


def test_a_simulated_message_of_several_steps_answers_its_decodes_in_each():
    workers = SimulatedWorkers(1, block_size=16, num_kv_blocks=64, max_batch_size=8)
    assert workers.description.max_decode_steps > 1
    request = worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
        step_id=4, decode_seq_ids=[5, 6], decode_new_blocks=[-1, -1], decode_steps=3, pack_plain_tokens=True))
    reply = worker_pb2.StepStreamResponse.FromString(workers.answer(request.SerializeToString()))
    assert list(reply.step.plain_seq_ids) == [5, 6] * 3 and list(reply.step.plain_token_ids) == [TOKEN_ID] * 6
    assert (workers.num_steps, workers.num_tokens) == (3, 6)


def test_a_tiny_point_runs_the_scheduler_process():
    args = parse_args(["--seconds", "0.3", "--repeats", "2", "--warmup-s", "0.1", "--max-tokens", "64"])
    row = asyncio.run(run_point(Point(1, 8), args))
    assert (row["workers"], row["sequences_per_worker"], row["windows"]) == (1, 8, 2)
    assert row["steps_per_s"] > 0 and row["tokens_per_s"] > 0 and row["scheduler_cpu_us_per_step"] > 0
    several = asyncio.run(run_point(Point(1, 8), args, decode_steps=4))  # the scheduler's max_decode_steps
    assert several["steps_per_s"] > 0 and several["tokens_per_s"] > 0
    rows = [{"tree": t, "round": 0, **row} for t in ("a", "b")]
    assert "| a | 1 | 8 |" in table(rows)
    assert "x1.00" in ab_summary(rows, ["a", "b"])
