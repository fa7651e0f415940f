"""A worker's refusals on a real EngineLoop (fake worker client): a sequence
refused alone ends its request only, with INVALID_ARGUMENT and the worker's
words (all of it: siblings, beam search), while the others run to their end and
the worker stays ready; the refusal of the step planned ahead is ignored; and a
step refused whole ends what ran on the worker but keeps it ready, without a
health poll, as a fault of the scheduler's own step loop does. Only a worker
that cannot be reached is lost."""
from __future__ import annotations

import asyncio
import dataclasses
import math

import grpc
import pytest

from services.common.errors import STEP_FAILED, WORKER_LOST
from services.scheduler import engine as engine_module
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequences
from services.scheduler.engine import EngineLoop, SequenceFailed
from services.scheduler.plan import StepAnswer
from services.scheduler.sequence import FinishReason, Sequence
from services.scheduler.worker_client import StepRefused, WorkerError
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.scheduler.test_engine_drain import STEP_S, FakeWorkerClient
from tests.unit.scheduler.test_policy import make_seq
from tests.unit.scheduler.test_siblings import assert_no_leak
from tests.unit.scheduler.streams import submit

TOO_MANY = "top_logprobs must be at most 256"
NOT_A_NUMBER = "temperature must be a number"
UNKNOWN = "unknown sequence"
MAX_TOKENS = 8


class RefusingWorkerClient(FakeWorkerClient):
    """Refuses as the worker does: a sequence whose first step asks top_logprobs
    above 256 or a temperature that is not a number, and any step of a sequence it does not
    hold (one planned before its refusal was seen, a steady decode too); the
    rest run on FakeWorker. `refuse_step`: that step ends the step stream with
    INVALID_ARGUMENT (a step refused whole)."""

    def __init__(self):
        super().__init__()
        self.held: set[int] = set()
        self.refusals: list[tuple[int, str]] = []  # (seq id, message) in order
        self.refuse_step: int | None = None
        self.stream_ended = False  # a step refused whole: the steps after it on the stream do not run

    async def describe(self):
        capacity, info = await super().describe()
        return dataclasses.replace(capacity, holds_block_tables=True), info  # decodes by id: steady ones too

    async def send(self, plan) -> None:
        if self.fail_with is not None:
            raise WorkerError(self.fail_with)
        if self.stream_ended:
            return
        if plan.step_id == self.refuse_step:
            self.refuse_step = None  # once: a fresh plan numbers its steps from 0 again
            self.stream_ended = True
            self.answers.put_nowait(StepRefused("worker w0: INVALID_ARGUMENT: seq 3 appears twice in one step"))
            return
        self.held.difference_update(plan.release_seq_ids)
        refused, kept = {}, []
        for entry in plan.scheduled:
            seq_id = entry.seq.seq_id
            if seq_id not in self.held and not entry.sends_sampling:
                refused[seq_id] = UNKNOWN
            elif entry.sends_sampling and entry.seq.sampling.top_logprobs > 256:
                refused[seq_id] = TOO_MANY
            elif entry.sends_sampling and math.isnan(entry.seq.sampling.temperature):
                refused[seq_id] = NOT_A_NUMBER
            else:
                self.held.add(seq_id)
                kept.append(entry)
        steady = [part for part in zip(*plan.steady[:3]) if part[1] in self.held]
        refused.update((seq_id, UNKNOWN) for seq_id in plan.steady.seq_ids if seq_id not in self.held)
        self.refusals += refused.items()
        steady_kept = plan.steady._replace(**dict(zip(("seqs", "seq_ids", "new_blocks"),
                                                      (list(c) for c in zip(*steady)) if steady else ([], [], []))))
        self.answers.put_nowait(StepAnswer(self.fake.step(dataclasses.replace(plan, scheduled=kept,
                                                                             steady=steady_kept)), refused))

    async def receive(self):
        await asyncio.sleep(STEP_S)
        answer = self.answers.get_nowait()
        if isinstance(answer, WorkerError):
            self.reset()  # as WorkerClient does: the stream is gone, the next send opens one
            self.held.clear()  # the worker forgets what the stream carried
            self.stream_ended = False
            raise answer
        return answer


async def started(client: FakeWorkerClient) -> EngineLoop:
    engine = EngineLoop(client, max_batch_size=8, max_prefill_tokens=64)  # type: ignore[arg-type]
    engine.start()
    for _ in range(100):
        if engine.is_ready:
            return engine
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not become ready")


async def outcome(stream, seqs) -> list[int] | SequenceFailed:
    """A request's tokens (of its first sequence) once all its sequences ended, or its failure."""
    tokens: list[int] = []
    while not (all(s.is_finished for s in seqs) and stream.empty()):  # a failure is queued as they end
        item = await asyncio.wait_for(stream.get(), 5)
        if isinstance(item, SequenceFailed):
            return item
        if item is not None and item[0] is seqs[0]:
            tokens.append(item[1].token_id)
    return tokens


def bad_request(request_id: str, sampling: dict | None = None, **fields) -> list[Sequence]:
    """The sequences of a request asking top_logprobs 1000 (or `sampling`), seq ids from 100 x its number."""
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[10, 11, 12, 13, 14, 15],
        sampling=scheduler_pb2.SamplingParams(**(sampling or {"top_logprobs": 1000})),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=MAX_TOKENS), **fields)
    ids = iter(range(100 * int(request_id[1:]), 100 * int(request_id[1:]) + 99))
    return to_sequences(request, lambda: next(ids), SchedulerConfig(max_batch_size=8), 1_000)[0]


@pytest.fixture(autouse=True)
def no_health_poll_after_start(monkeypatch):
    """Readiness after a refusal must not wait for a health poll: there is none."""
    monkeypatch.setattr(engine_module, "HEALTH_POLL_S", 3600.0)


@pytest.mark.parametrize("fields", [{}, {"n": 3}, {"n": 2, "best_of": 3}, {"use_beam_search": True, "n": 2}],
                         ids=["one", "n=3", "best_of", "beam search"])
def test_a_refused_sequence_fails_its_request_only(fields):
    async def scenario():
        client = RefusingWorkerClient()
        engine = await started(client)
        try:
            good = [[make_seq(i, prompt_len=6, max_tokens=MAX_TOKENS)] for i in (1, 2, 3, 4)]
            bad = bad_request("r9", **fields)
            requests = good[:2] + [bad] + good[2:]  # the bad one in the middle of the queue
            streams = [submit(engine, seqs) for seqs in requests]
            results = await asyncio.gather(*(outcome(s, seqs) for s, seqs in zip(streams, requests)))
            assert engine.is_ready
            after = [make_seq(5, prompt_len=6, max_tokens=MAX_TOKENS)]
            results.append(await outcome(submit(engine, after), after))
            for _ in range(100):  # the releases go out with the next steps
                if not engine.policy.has_work():
                    break
                await asyncio.sleep(0.01)
            return results, client, engine, good + [after], bad
        finally:
            await engine.stop()

    results, client, engine, good, bad = asyncio.run(scenario())
    assert results[2] == SequenceFailed(TOO_MANY, grpc.StatusCode.INVALID_ARGUMENT)
    assert all(r == [7] * MAX_TOKENS for i, r in enumerate(results) if i != 2)
    assert all(s.finish_reason is FinishReason.LENGTH for seqs in good for s in seqs)
    assert all(s.is_finished and s.finish_reason is FinishReason.ABORT for s in bad)
    refused = {seq_id for seq_id, _ in client.refusals}
    assert refused and all(seq_id >= 900 for seq_id in refused)  # only the bad request's sequences
    assert (min(refused), TOO_MANY) == client.refusals[0]
    assert_no_leak(engine.policy)


@pytest.mark.parametrize("sampling, reason", [
    ({"top_logprobs": 1000}, TOO_MANY),
    ({"temperature": math.nan}, NOT_A_NUMBER),
], ids=["top_logprobs", "temperature (a steady decode next)"])
def test_the_refusal_of_the_step_planned_ahead_is_ignored(sampling, reason):
    """The bad sequence's first step samples, so the step after it (sent before the
    refusal came back) feeds it its token, as a steady decode where nothing else
    is asked: the worker refuses that one as unknown, and the request still ends
    once, with the first refusal's words, while its batch-mate runs to its end."""
    async def scenario():
        client = RefusingWorkerClient()
        engine = await started(client)
        try:
            bad = bad_request("r9", sampling)
            good = [make_seq(1, prompt_len=6, max_tokens=MAX_TOKENS)]
            streams = [submit(engine, bad), submit(engine, good)]
            failure = await outcome(streams[0], bad)
            tokens = await outcome(streams[1], good)
            await asyncio.sleep(5 * STEP_S)
            return failure, tokens, streams[0], client
        finally:
            await engine.stop()

    failure, tokens, stream, client = asyncio.run(scenario())
    assert client.refusals == [(900, reason), (900, UNKNOWN)]
    assert failure == SequenceFailed(reason, grpc.StatusCode.INVALID_ARGUMENT)
    assert tokens == [7] * MAX_TOKENS
    assert stream.empty()  # nothing more was delivered


def test_a_step_refused_whole_ends_what_ran_but_keeps_the_worker_ready():
    async def scenario():
        client = RefusingWorkerClient()
        client.refuse_step = 2
        engine = await started(client)
        try:
            running = [[make_seq(i, prompt_len=6, max_tokens=MAX_TOKENS)] for i in (1, 2)]
            streams = [submit(engine, seqs) for seqs in running]
            failures = await asyncio.gather(*(outcome(s, seqs) for s, seqs in zip(streams, running)))
            ready = engine.is_ready  # at once: no health poll comes
            after = [make_seq(3, prompt_len=6, max_tokens=MAX_TOKENS)]
            return failures, ready, await outcome(submit(engine, after), after), engine
        finally:
            await engine.stop()

    failures, ready, tokens, engine = asyncio.run(scenario())
    assert failures == [SequenceFailed(STEP_FAILED, grpc.StatusCode.UNAVAILABLE)] * 2
    assert STEP_FAILED != WORKER_LOST
    assert ready and tokens == [7] * MAX_TOKENS


def test_a_worker_that_cannot_be_reached_is_still_lost():
    async def scenario():
        client = RefusingWorkerClient()
        engine = await started(client)
        try:
            seqs = [make_seq(1, prompt_len=6, max_tokens=MAX_TOKENS)]
            stream = submit(engine, seqs)
            await asyncio.wait_for(stream.get(), 5)
            client.fail_with = "worker w0: UNAVAILABLE: Socket closed"
            return await outcome(stream, seqs), engine.is_ready
        finally:
            await engine.stop()

    failure, ready = asyncio.run(scenario())
    assert failure == SequenceFailed(WORKER_LOST) and not ready


def test_a_fault_in_the_step_loop_ends_the_requests_on_the_worker_and_the_loop_goes_on(caplog) -> None:
    """A scheduler bug raised in the step loop: the requests on that worker end
    with an error (none waits on a loop that died), and the next one is served."""
    from services.common.errors import STEP_LOOP_FAILED
    from tests.unit.scheduler.test_engine_drain import started_engine, tokens_until_end

    async def scenario() -> None:
        engine, _ = await started_engine()
        stream = submit(engine, [make_seq(1, prompt_len=6, max_tokens=200)])
        assert isinstance(await asyncio.wait_for(stream.get(), 5), tuple)
        policy = engine.policy

        def fails(*_):
            raise KeyError(7)

        policy.postprocess = fails
        items = await asyncio.wait_for(tokens_until_end(stream, 200), 5)
        assert isinstance(items[-1], SequenceFailed) and items[-1].message == STEP_LOOP_FAILED
        assert engine.is_ready and engine.policy is not policy and engine.load == 0
        after = submit(engine, [make_seq(2, prompt_len=6, max_tokens=MAX_TOKENS)])
        items = await asyncio.wait_for(tokens_until_end(after, MAX_TOKENS), 5)
        assert len(items) == MAX_TOKENS and all(isinstance(i, tuple) for i in items) and items[-1][0].is_finished
        await engine.stop()

    asyncio.run(scenario())
    assert "the step loop failed" in caplog.text and "KeyError: 7" in caplog.text
