"""Beam search on the fake worker: the policy's search (lockstep beams, forks that
share full blocks and copy the partial one, ends and early stop) gives exactly
what the same search computes without any KV cache, under preemption too, and
leaves no block behind after an end, an abort or a worker loss."""
from __future__ import annotations

import grpc
import pytest

from services.common.errors import ServiceError
from services.scheduler.beam import beam_score
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequences
from services.scheduler.policy import CapacityError
from services.scheduler.sequence import FinishReason
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.scheduler.test_batching import run_to_end
from tests.unit.scheduler.test_policy import EOS, FakeWorker, distribution, make_policy, make_seq
from tests.unit.scheduler.test_siblings import assert_no_leak

CONFIG = SchedulerConfig(max_batch_size=8)


def beam_request(prompt_len=9, n=2, best_of=None, max_tokens=6, ignore_eos=False, top_logprobs=None,
                 **sampling) -> scheduler_pb2.GenerateRequest:
    req = scheduler_pb2.GenerateRequest(
        request_id="beam", prompt_token_ids=list(range(30, 30 + prompt_len)), use_beam_search=True, n=n,
        sampling=scheduler_pb2.SamplingParams(**sampling),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos),
    )
    if best_of is not None:
        req.best_of = best_of
    if top_logprobs is not None:
        req.sampling.top_logprobs = top_logprobs
    return req


def build(req, first_id=100):
    ids = iter(range(first_id, first_id + 10_000))
    return to_sequences(req, lambda: next(ids), CONFIG, 1_000)


def search_without_kv(prompt, width, n, max_tokens, ignore_eos=False):
    """The same search on whole contexts: [(tokens, cumulative logprob, ended by EOS)], best first."""
    beams, finished = [([], 0.0)], []
    while True:
        ranked = sorted(
            ((cum + lp, order, rank, tokens, token)
             for order, (tokens, cum) in enumerate(beams)
             for rank, (token, lp) in enumerate(distribution(prompt + tokens)[: 2 * width])),
            key=lambda c: (-c[0], c[1], c[2]))
        beams = []
        for position, (total, _, _, tokens, token) in enumerate(ranked):
            if len(beams) == width:
                break
            if token == EOS and not ignore_eos:
                if position < width:
                    finished.append((tokens + [token], total, True))
                continue
            beams.append((tokens + [token], total))
        finished = sorted(finished, key=lambda h: -beam_score(h[1], len(h[0])))[:width]
        if not beams or len(beams[0][0]) >= max_tokens:
            break
        if len(finished) >= width and max(beam_score(c, len(t)) for t, c in beams) <= min(
                beam_score(c, len(t)) for t, c, _ in finished):
            break
    hypotheses = finished + [(tokens, cum, False) for tokens, cum in beams]
    return sorted(hypotheses, key=lambda h: -beam_score(h[1], len(h[0])))[:n]


def results_of(results):
    return [(r.output_token_ids, r.cumulative_logprob, r.ended_by_stop_token) for r in results]


def assert_same(got, want):
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want])


@pytest.mark.parametrize("prompt_len, width, n, max_tokens", [
    (9, 2, 2, 6), (8, 3, 1, 7), (3, 4, 4, 9), (11, 1, 1, 5), (5, 5, 3, 12),
])
def test_search_matches_the_search_without_a_kv_cache(prompt_len, width, n, max_tokens):
    policy = make_policy()
    worker = FakeWorker(policy=policy)  # asserts no write ever lands in a shared block
    results, choices = build(beam_request(prompt_len, n=n, best_of=width, max_tokens=max_tokens))
    policy.add_group(results)
    assert [s.seq_id for s in policy.waiting] == [100]  # one beam prefills the prompt
    run_to_end(policy, worker)
    want = search_without_kv(list(range(30, 30 + prompt_len)), width, n, max_tokens)
    assert_same(results_of(results), want)
    for result, (_, _, ended_by_eos) in zip(results, want):
        assert result.is_finished and result.finish_reason is (FinishReason.STOP if ended_by_eos else FinishReason.LENGTH)
    assert worker.num_first_steps > 1 or width == 1  # forks ran as new sequences on the worker
    assert_no_leak(policy)


def test_forks_copy_a_partial_block_and_share_full_ones():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    results, _ = build(beam_request(prompt_len=9, n=3, max_tokens=4))
    policy.add_group(results)
    copies = []
    while policy.has_work():
        plan = policy.schedule()
        copies += plan.block_copies
        # A copy writes a block only its new beam holds, from one its parent holds.
        assert all(policy.blocks.blocks[dst].ref_count == 1 for _, dst in plan.block_copies)
        assert all(policy.blocks.blocks[src].ref_count >= 1 for src, _ in plan.block_copies)
        policy.postprocess(plan, worker.step(plan), 2_000, 3_000)
    assert copies  # 9 prompt tokens: the forks' third block is partial
    assert_same(results_of(results), search_without_kv(list(range(30, 39)), 3, 3, 4))
    assert_no_leak(policy)


def test_ignore_eos_lets_beams_run_through_eos():
    results, _ = build(beam_request(prompt_len=4, n=2, max_tokens=10, ignore_eos=True))
    policy = make_policy()
    policy.add_group(results)
    run_to_end(policy, FakeWorker(policy=policy))
    assert_same(results_of(results), search_without_kv(list(range(30, 34)), 2, 2, 10, ignore_eos=True))
    assert all(len(r.output_token_ids) == 10 for r in results)
    assert_no_leak(policy)


def test_results_stream_whole_under_their_index_with_logprobs_only_when_asked():
    for top_logprobs, reported in ((None, 0), (3, 3)):
        results, choices = build(beam_request(prompt_len=6, n=2, max_tokens=5, top_logprobs=top_logprobs))
        assert results[0].sampling.top_logprobs == max(4, top_logprobs or 0)  # 2 x width candidates
        policy = make_policy()
        policy.add_group(results)
        items = []
        worker = FakeWorker(policy=policy)
        while policy.has_work():
            plan = policy.schedule()
            items += policy.postprocess(plan, worker.step(plan), 2_000, 3_000)
        assert {seq.seq_id for seq, _ in items} == {r.seq_id for r in results}  # only results are delivered
        updates = choices.accept(items)
        assert [(u.index, u.is_first, u.is_last) for u in updates] == [(0, True, True), (1, True, True)]
        assert [[e.token_id for e in u.events] for u in updates] == [r.output_token_ids for r in results]
        assert all(len(e.top_logprobs) == reported for u in updates for e in u.events)
        assert choices.is_done and choices.report_logprobs == (top_logprobs is not None)
        with pytest.raises(ServiceError):
            choices.sibling_of(0)


def test_abort_mid_search_ends_every_choice_and_frees_everything():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    results, choices = build(beam_request(prompt_len=9, n=2, best_of=3, max_tokens=20, ignore_eos=True))
    other = make_seq(1, prompt_len=6, max_tokens=10)
    policy.add_group(results)
    policy.add(other)
    for _ in range(4):
        plan = policy.schedule()
        policy.postprocess(plan, worker.step(plan), 2_000, 3_000)
    assert len(results[0].beam.beams) == 3
    live = list(results[0].beam.beams)
    for result in choices.unfinished:
        policy.finish(result, FinishReason.ABORT)
    assert all(r.finish_reason is FinishReason.ABORT for r in results) and not choices.unfinished
    assert all(b.is_finished for b in live)
    run_to_end(policy, worker)
    assert set(worker.released) >= {b.seq_id for b in live}
    assert other.is_finished and other.finish_reason is FinishReason.LENGTH
    assert_no_leak(policy)


def test_preemption_under_a_tight_pool_still_gives_the_same_beams():
    prompt = list(range(30, 39))
    want = search_without_kv(prompt, 3, 2, 16, ignore_eos=True)
    # 3 beams x 25 tokens = 21 blocks of 4, the whole pool: the older requests' blocks
    # (11 each at the end) must come from preemptions, of them and of beams.
    policy = make_policy(num_blocks=21, max_prefill_tokens=16)
    worker = FakeWorker(policy=policy)
    older = [make_seq(i, prompt_len=3, max_tokens=40) for i in (1, 2, 3, 4)]
    for seq in older:
        policy.add(seq)
    results, _ = build(beam_request(prompt_len=9, n=2, best_of=3, max_tokens=16, ignore_eos=True))
    policy.add_group(results)
    run_to_end(policy, worker)
    assert policy.num_preemptions > 0
    assert_same(results_of(results), want)
    assert all(s.finish_reason is FinishReason.LENGTH for s in older)
    assert_no_leak(policy)


@pytest.mark.parametrize("prompt_len, max_tokens, num_blocks", [(2, 5, 8), (3, 4, 8), (8, 7, 12)])
def test_searches_that_fit_the_pool_only_one_at_a_time_both_finish(prompt_len, max_tokens, num_blocks):
    # Each search alone fits (3 beams x its length); together, beams of each wait
    # for room the other holds, until the older one is let through whole.
    policy = make_policy(num_blocks=num_blocks, max_prefill_tokens=16)
    worker = FakeWorker(policy=policy)
    searches = []
    for first_id, start in ((100, 30), (200, 40)):
        prompt = list(range(start, start + prompt_len))
        req = beam_request(prompt_len=prompt_len, n=2, best_of=3, max_tokens=max_tokens, ignore_eos=True)
        req.prompt_token_ids[:] = prompt
        results, _ = build(req, first_id=first_id)
        policy.add_group(results)
        searches.append((results, prompt))
    run_to_end(policy, worker, max_steps=2_000)
    for results, prompt in searches:
        assert_same(results_of(results), search_without_kv(prompt, 3, 2, max_tokens, ignore_eos=True))
    assert_no_leak(policy)


def test_a_lost_worker_ends_the_search_without_leaks():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    results, choices = build(beam_request(prompt_len=5, n=2, max_tokens=10, ignore_eos=True))
    policy.add_group(results)
    for _ in range(3):
        plan = policy.schedule()
        policy.postprocess(plan, worker.step(plan), 2_000, 3_000)
    for seq in policy.unfinished_sequences():  # as EngineLoop does when the worker is lost
        policy.finish(seq, FinishReason.ABORT)
    policy.forget_worker_state()
    for result in choices.unfinished:  # then the request's own abort
        policy.finish(result, FinishReason.ABORT)
    assert not choices.unfinished
    assert policy.schedule() is None
    assert_no_leak(policy)


def test_a_search_that_cannot_fit_whole_is_refused_up_front():
    results, _ = build(beam_request(prompt_len=9, n=2, best_of=4, max_tokens=20))
    policy = make_policy(num_blocks=24)  # one beam needs 8 blocks: 4 need 32
    with pytest.raises(CapacityError, match="4 beams"):
        policy.add_group(results)


@pytest.mark.parametrize("change, message", [
    ({"n": 9}, "beam width"),
    ({"n": 2, "best_of": 9}, "beam width"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"max_tokens": 129}, "max_tokens <= 128"),
])
def test_invalid_beam_searches_are_refused(change, message):
    max_tokens = change.pop("max_tokens", 6)
    with pytest.raises(ServiceError, match=message) as info:
        build(beam_request(max_tokens=max_tokens, **change))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_beam_search_refuses_token_level_conflicts_and_the_default_max_tokens():
    req = beam_request()
    req.stopping.stop_token_ids.append(5)
    with pytest.raises(ServiceError, match="stop_token_ids"):
        build(req)
    req = beam_request()
    req.sampling.grammar.kind = scheduler_pb2.GRAMMAR_KIND_JSON_OBJECT
    with pytest.raises(ServiceError, match="response_format"):
        build(req)
    req = beam_request()
    req.stopping.ClearField("max_tokens")  # maxIterTimes 512 by default, as the reference refuses
    with pytest.raises(ServiceError, match="the default"):
        build(req)


def test_best_of_below_n_is_not_checked_and_the_width_is_the_larger():
    results, choices = build(beam_request(n=3, best_of=2))
    assert len(results) == 3 and results[0].beam.width == 3 and choices.n == 3
