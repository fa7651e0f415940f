"""A request's choices on its stream: n, best_of, indices, seeds and the protobuf
fields (the tokenizer's side of the contract)."""
from __future__ import annotations

import grpc
import pytest

from services.common.errors import ServiceError
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import fill_response, to_sequences
from services.scheduler.sequence import FinishReason, SequenceStatus, TokenEvent
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.scheduler.test_batching import run_to_end
from tests.unit.scheduler.test_policy import FakeWorker, make_policy

CONFIG = SchedulerConfig(max_batch_size=8)


def request(n=None, best_of=None, seed=7, top_logprobs=None, **extra) -> scheduler_pb2.GenerateRequest:
    sampling = scheduler_pb2.SamplingParams(seed=seed, temperature=0.8)
    if top_logprobs is not None:
        sampling.top_logprobs = top_logprobs
    req = scheduler_pb2.GenerateRequest(request_id="r", prompt_token_ids=list(range(10, 21)), sampling=sampling,
                                        stopping=scheduler_pb2.StoppingCriteria(max_tokens=5), **extra)
    if n is not None:
        req.n = n
    if best_of is not None:
        req.best_of = best_of
    return req


def build(req):
    ids = iter(range(1, 1000))
    return to_sequences(req, lambda: next(ids), CONFIG, 1_000)


def event(token: int) -> TokenEvent:
    return TokenEvent(token_id=token, batch_size=1, queue_wait_us=0, latency_ms=0.0, logprob=-0.5)


def finish(seq, cumulative: float) -> None:
    seq.status, seq.finish_reason, seq.cumulative_logprob = SequenceStatus.FINISHED, FinishReason.LENGTH, cumulative


def test_defaults_are_one_choice_with_the_request_seed_and_no_internal_logprobs():
    seqs, choices = build(request())
    assert len(seqs) == 1 and choices.n == 1 and not choices.has_logprobs
    assert seqs[0].sampling.seed == 7 and seqs[0].sampling.top_logprobs == -1


def test_siblings_get_distinct_reproducible_seeds_and_internal_logprobs():
    seqs, choices = build(request(n=2, best_of=4))
    seeds = [s.sampling.seed for s in seqs]
    assert seeds[0] == 7 and len(set(seeds)) == 4 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [s.sampling.seed for s in build(request(n=2, best_of=4))[0]]
    assert [s.index for s in seqs] == [0, 1, 2, 3] and len({s.seq_id for s in seqs}) == 4
    assert all(s.sampling.top_logprobs == 0 for s in seqs)  # to rank them
    assert choices.is_selecting and not choices.report_logprobs


@pytest.mark.parametrize("kwargs, code", [
    ({"n": 0}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"n": 3, "best_of": 2}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"n": 9}, grpc.StatusCode.INVALID_ARGUMENT),  # > maxBatchSize
])
def test_invalid_combinations_are_refused(kwargs, code):
    with pytest.raises(ServiceError) as info:
        build(request(**kwargs))
    assert info.value.code == code


def test_best_of_equal_to_n_streams_each_choice_under_its_own_index():
    seqs, choices = build(request(n=2))
    a, b = seqs
    updates = choices.accept([(b, event(1)), (a, event(2)), (b, event(3))])
    assert [(u.index, [e.token_id for e in u.events], u.is_first, u.is_last) for u in updates] == [
        (1, [1, 3], True, False), (0, [2], True, False)]
    finish(b, -1.5)
    updates = choices.accept([(b, event(4))])
    assert [(u.index, u.is_last) for u in updates] == [(1, True)] and not choices.is_done
    reply = fill_response(scheduler_pb2.GenerateResponse(), updates[0], choices)
    assert reply.index == 1 and reply.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert reply.cumulative_logprob == -1.5 and not reply.tokens[0].HasField("logprob")  # not asked
    finish(a, -2.0)
    assert [(u.index, u.events, u.is_last) for u in choices.accept([])] == [(0, [], True)]
    assert choices.is_done


def test_best_of_holds_everything_then_sends_the_best_n_renumbered():
    seqs, choices = build(request(n=2, best_of=3, top_logprobs=0))
    for seq in seqs:
        assert choices.accept([(seq, event(seq.index))]) == []
    finish(seqs[0], -3.0)
    finish(seqs[1], -1.0)
    assert choices.accept([(seqs[1], event(11))]) == []  # one sibling still runs
    finish(seqs[2], -2.0)
    updates = choices.accept([(seqs[2], event(12))])
    assert [(u.index, u.seq.index, [e.token_id for e in u.events], u.is_first, u.is_last) for u in updates] == [
        (0, 1, [1, 11], True, True), (1, 2, [2, 12], True, True)]
    replies = [fill_response(scheduler_pb2.GenerateResponse(), u, choices) for u in updates]
    assert [r.cumulative_logprob for r in replies] == [-1.0, -2.0]
    assert replies[0].prompt_tokens == 11 and replies[0].tokens[0].logprob == -0.5  # asked: reported
    assert choices.is_done


def test_abort_ends_every_unfinished_choice():
    seqs, choices = build(request(n=2, best_of=3))
    choices.accept([(seqs[0], event(1))])
    for seq in seqs:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
    updates = choices.accept([])
    assert len(updates) == 2 and all(u.is_last for u in updates) and choices.is_done
    assert fill_response(scheduler_pb2.GenerateResponse(), updates[0], choices).finish_reason == scheduler_pb2.FINISH_REASON_ABORT


def test_end_to_end_on_the_fake_worker_is_reproducible():
    def run():
        seqs, choices = build(request(n=2, best_of=3))
        policy = make_policy()
        policy.add_group(seqs)
        run_to_end(policy, FakeWorker(policy=policy))
        return [(s.index, s.output_token_ids, s.cumulative_logprob) for s in seqs]
    first = run()
    assert first == run()
    assert all(cum < 0 for _, _, cum in first)
    # The leader is the request alone (n = 1) with the same seed.
    alone, _ = build(request())
    policy = make_policy()
    policy.add(alone[0])
    run_to_end(policy, FakeWorker(policy=policy))
    assert alone[0].output_token_ids == first[0][1]


def test_a_single_choice_can_be_aborted_only_while_choices_stream():
    seqs, choices = build(request(n=3))
    assert choices.sibling_of(2) == 2
    with pytest.raises(ServiceError):
        choices.sibling_of(3)
    seqs[1].status, seqs[1].finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
    assert [(u.index, u.is_last) for u in choices.accept([])] == [(1, True)] and not choices.is_done
    _, selecting = build(request(n=1, best_of=2))
    with pytest.raises(ServiceError):
        selecting.sibling_of(0)


def test_only_the_middle_tokens_of_one_plain_choice_may_go_packed():
    (seq,), choices = build(request())
    assert choices.packable() is None  # the first message carries the prompt's figures
    choices.accept([(seq, event(1))])
    assert choices.packable() is seq
    finish(seq, -1.0)
    assert choices.packable() is None  # the last message carries the finish reason
    for req in (request(top_logprobs=0), request(n=2), request(best_of=2)):
        seqs, choices = build(req)
        choices.accept([(seqs[0], event(1))])
        assert choices.packable() is None
