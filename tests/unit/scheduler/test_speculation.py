"""Speculative decoding in the scheduler: the drafters, the adaptive draft length,
and the policy on a fake worker that verifies drafts as the real one does — the
same tokens as without speculation, exact block accounting, per-token figures."""
from __future__ import annotations

import random

import pytest

from services.scheduler.drafting import (
    ContinuationCounts,
    GlobalSuffixCounts,
    LatestOccurrence,
    SuffixCounts,
    most_frequent_path,
)
from services.scheduler.sequence import FinishReason, SamplingParams
from services.scheduler.speculation import FIRST_PAUSE_TOKENS, SpeculationConfig, Speculator
from tests.unit.scheduler.test_batching import run_to_end
from tests.unit.scheduler.test_pipelining import requests, run_ahead
from tests.unit.scheduler.test_policy import FakeWorker, make_policy, make_seq, run_step
from tests.unit.scheduler.test_siblings import assert_no_leak

LOOKUP = SpeculationConfig("prompt_lookup", max_draft_tokens=4, draft_token_budget=16)
SUFFIX = SpeculationConfig("suffix", max_draft_tokens=6, draft_token_budget=16)


# -- drafters ------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    index = LatestOccurrence()
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 8, 2, 3])
    # [2, 3] occurs twice before the tail: the latest is followed by 5, 6, 7.
    assert index.propose(3) == [5, 6, 7]
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 8, 2, 3, 4, 9])
    # The longer match [3, 4, 9] (and [2, 3, 4, 9]) wins over later shorter ones.
    assert index.propose(2) == [2, 3]
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 8, 2, 3, 4, 9, 77])
    assert index.propose(4) == []  # [9, 77] never occurred before


def test_prompt_lookup_draft_stops_at_the_end_of_the_tokens():
    index = LatestOccurrence()
    index.extend([5, 6, 7, 5, 6])
    assert index.propose(8) == [7, 5, 6]


def test_suffix_counts_propose_the_most_frequent_continuation():
    counts = SuffixCounts()
    counts.extend([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    # After [1, 2]: 3 three times, 4 once; after [.., 2, 3]: 1 twice, 9 once.
    assert most_frequent_path(counts.tokens, [counts.own], 3) == [3, 1, 2]


def test_suffix_draft_length_follows_the_match_length_and_its_probability():
    counts = SuffixCounts()
    counts.extend([7, 8, 50, 51, 52, 53, 54, 55, 8])
    # Only the one-token context [8] matches: at most 2 tokens (twice the match).
    assert most_frequent_path(counts.tokens, [counts.own], 6) == [50, 51]
    flat = ContinuationCounts()
    flat.add([5, 1, 5, 2, 5, 3, 5, 4, 5, 6, 5, 7, 5, 8, 5, 9, 5, 10, 5, 11, 5, 12], 0)
    # After 5, twelve tokens once each: probability 1/11 < 0.1, no draft.
    assert most_frequent_path([5], [flat], 4) == []


def test_global_counts_carry_finished_outputs_to_new_sequences_and_stay_bounded():
    speculator = Speculator(SUFFIX)
    done = make_seq(1, prompt_len=3, max_tokens=20)
    done.output_token_ids = [60, 61, 62, 63, 64, 65, 66, 67]
    speculator.on_finished(done)
    fresh = make_seq(2, prompt_len=3, max_tokens=20)
    fresh.prompt_token_ids = [30, 60, 61, 62]  # never seen in its own tokens
    assert speculator.propose(fresh, 4) == [63, 64, 65, 66]
    bounded = GlobalSuffixCounts(max_tokens=50)
    for n in range(40):
        bounded.add_output([n, n + 1, n + 2])
    assert bounded.counts.num_tokens <= 50
    assert (39, 40) in bounded.counts.counts and (0, 1) not in bounded.counts.counts  # the oldest went


# -- adaptive draft length ----------------------------------------------------
def test_draft_length_follows_acceptance_and_drafting_pauses_when_it_does_not_pay():
    speculator = Speculator(SpeculationConfig("prompt_lookup", max_draft_tokens=6, draft_token_budget=16))
    seq = make_seq(1, prompt_len=3, max_tokens=500)
    seq.prompt_token_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert speculator.draft_budget(2) == 14  # beside another sequence
    assert speculator.propose(seq, 10) == [3, 4, 5, 6, 7, 8]
    speculator.on_verified(seq, 6, 1)
    assert speculator.propose(seq, 10) == [3, 4]  # one more than kept
    speculator.on_verified(seq, 2, 2)
    assert len(speculator.propose(seq, 10)) == 4  # twice as long after a draft kept whole
    speculator.on_verified(seq, 4, 4)
    assert len(speculator.propose(seq, 10)) == 6  # at most max_draft_tokens
    for _ in range(5):  # nothing kept: the gain average falls below PAUSE_BELOW, drafting pauses
        speculator.on_verified(seq, 1, 0)
    assert not speculator.wants_draft(seq, 2) and speculator.propose(seq, 10) == []
    seq.output_token_ids = [0] * FIRST_PAUSE_TOKENS  # the pause is over: a probe
    assert speculator.wants_draft(seq, 2)


def test_a_sequence_alone_drafts_the_most_through_more_misses():
    speculator = Speculator(SpeculationConfig("prompt_lookup", max_draft_tokens=6, draft_token_budget=16))
    seq = make_seq(1, prompt_len=3, max_tokens=500)
    seq.prompt_token_ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert speculator.wants_draft(seq, 1)
    for _ in range(5):  # the average falls to 0.17: below PAUSE_BELOW, not below PAUSE_BELOW_ALONE
        speculator.on_verified(seq, 1, 0)
    # and drafts the most after each miss
    assert speculator.wants_draft(seq, 1) and speculator.propose(seq, 10) == [3, 4, 5, 6, 7, 8]
    speculator.on_verified(seq, 6, 0)  # 0.12
    assert not speculator.wants_draft(seq, 1) and speculator.propose(seq, 10) == []


def test_load_lowers_the_draft_budget_to_none():
    speculator = Speculator(SpeculationConfig("prompt_lookup", max_draft_tokens=6, draft_token_budget=16))
    seq = make_seq(1)
    seq.prompt_token_ids = [5, 6, 7, 5, 6]
    assert speculator.draft_budget(1) == 15 and speculator.wants_draft(seq, 15)
    assert speculator.draft_budget(16) == 0 and not speculator.wants_draft(seq, 16)
    assert Speculator(SpeculationConfig("off")).draft_budget(1) == 0


@pytest.mark.parametrize("sampling", [SamplingParams(top_logprobs=0), SamplingParams(repetition_penalty=1.1),
                                      SamplingParams(grammar=(1, ""))])
def test_sequences_needing_per_token_state_never_draft(sampling):
    policy = make_policy(speculation=LOOKUP)
    worker = FakeWorker(policy=policy, copy_period=2)
    seq = make_seq(1, prompt_len=6, max_tokens=30)
    seq.sampling = sampling
    policy.add(seq)
    while policy.has_work():
        plan, _ = run_step(policy, worker)
        assert all(not e.draft_token_ids for e in plan.scheduled)
    assert policy.speculator.num_drafts == 0


# -- the policy with drafts -------------------------------------------------------
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("config", [LOOKUP, SUFFIX], ids=["lookup", "suffix"])
def test_drafting_gives_the_same_tokens_and_leaks_nothing(seed, config):
    """Random request mixes (siblings, beams, stop tokens, budgets) on small pools
    that preempt, stepped plainly and planned ahead: the same outputs, finish
    reasons and delivered tokens as without speculation."""
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 12, 200])
    max_prefill = rng.choice([4, 16, 1000])
    results = []
    for speculation, ahead in ((None, False), (config, False), (config, True)):
        policy = make_policy(num_blocks=num_blocks, max_prefill_tokens=max_prefill, speculation=speculation)
        worker = FakeWorker(policy=policy, copy_period=3)
        every, groups = requests(random.Random(seed), num_blocks)
        for group in groups:
            policy.add_group(group)
        outputs = (run_ahead if ahead else run_to_end)(policy, worker)
        results.append(({s.seq_id: (s.output_token_ids, s.finish_reason) for s in every}, outputs))
        assert_no_leak(policy)
    assert results[0] == results[1] == results[2]


def test_drafts_kept_whole_in_part_and_not_at_all_with_a_cancel_midway():
    policy = make_policy(num_blocks=30, speculation=LOOKUP)
    worker = FakeWorker(policy=policy, copy_period=4)
    seqs = [make_seq(i, prompt_len=9, max_tokens=60) for i in (1, 2, 3, 4)]
    for seq in seqs:
        seq.sampling = SamplingParams(seed=seq.seq_id)  # each its own text
        policy.add(seq)
    kept_counts = set()
    for step in range(200):
        if step == 12:
            policy.finish(seqs[2], FinishReason.ABORT)  # while it drafts
        plan, _ = run_step(policy, worker)
        if plan is None:
            break
        for entry in plan.scheduled:
            if entry.draft_token_ids:
                seq = entry.seq
                kept = seq.num_computed_tokens - entry.num_computed_tokens - 1 if not seq.is_finished else None
                kept_counts.add((len(entry.draft_token_ids), kept))
    assert_no_leak(policy)
    kept = {(n, k) for n, k in kept_counts if k is not None}
    assert any(k == n for n, k in kept) and any(0 < k < n for n, k in kept) and any(k == 0 for n, k in kept)


def test_tokens_of_one_step_share_its_figures():
    policy = make_policy(speculation=LOOKUP)
    worker = FakeWorker(policy=policy, copy_period=2)
    seq = make_seq(1, prompt_len=6, max_tokens=30)
    policy.add(seq)
    run_step(policy, worker, started=2_000, finished=3_000)  # the prompt
    multi = None
    for n in range(20):
        start = 10_000 * (n + 1)
        plan, events = run_step(policy, worker, started=start + 400, finished=start + 1_000)
        if len(events) > 1:
            multi = (events, seq.last_event_us)
            break
    assert multi is not None, "no step kept a draft"
    events, _ = multi
    assert len({e.batch_size for _, e in events}) == 1
    assert len({(e.queue_wait_us, e.latency_ms) for _, e in events}) == 1
    # Split evenly: the sums are the step's wait and latency since the previous token.
    previous_us = 3_000 if n == 0 else 10_000 * n + 1_000
    assert sum(e.latency_ms for _, e in events) == pytest.approx((10_000 * (n + 1) + 1_000 - previous_us) / 1000)


def test_no_drafts_while_requests_wait_for_admission():
    policy = make_policy(max_batch_size=1, speculation=LOOKUP)  # the second request waits for the first
    worker = FakeWorker(policy=policy, copy_period=2)
    first, second = make_seq(1, prompt_len=6, max_tokens=12), make_seq(2, prompt_len=6, max_tokens=12)
    policy.add(first)
    policy.add(second)
    drafts_while_waiting = drafts_after = 0
    while policy.has_work():
        is_waiting = bool(policy.waiting)
        plan, _ = run_step(policy, worker)
        num_drafts = sum(bool(e.draft_token_ids) for e in plan.scheduled)
        if is_waiting:
            drafts_while_waiting += num_drafts
        else:
            drafts_after += num_drafts
    assert drafts_while_waiting == 0 and drafts_after > 0
    assert_no_leak(policy)
