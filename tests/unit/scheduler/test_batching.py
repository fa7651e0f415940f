"""SplitFuse batching, prefix reuse and preemption on a fake worker that keeps
its "KV" only through the block tables it is sent: no leak after any mix of
finish, cancel, preempt and worker error, and the same text as a solo run."""
from __future__ import annotations

import random

import pytest

from services.scheduler.policy import BatchPolicy
from services.scheduler.sequence import FinishReason, SamplingParams
from services.scheduler.speculation import SpeculationConfig
from tests.unit.scheduler.test_policy import FakeWorker, make_policy, make_seq, run_step


def run_to_end(policy: BatchPolicy, worker: FakeWorker, max_steps: int = 10_000) -> dict[int, list[int]]:
    outputs: dict[int, list[int]] = {}
    for _ in range(max_steps):
        if not policy.has_work():
            return outputs
        _, events = run_step(policy, worker)
        for seq, event in events:
            outputs.setdefault(seq.seq_id, []).append(event.token_id)
    raise AssertionError("the policy stopped making progress")


def solo_text(prompt_len: int, max_tokens: int, seq_id: int) -> list[int]:
    policy = make_policy(num_blocks=100)
    policy.add(make_seq(seq_id, prompt_len=prompt_len, max_tokens=max_tokens))
    return run_to_end(policy, FakeWorker(policy=policy))[seq_id]


def test_long_prompt_is_chunked_while_decodes_keep_flowing():
    policy = make_policy(max_prefill_tokens=8)
    worker = FakeWorker(policy=policy)
    policy.add(make_seq(1, prompt_len=3, max_tokens=10))
    run_step(policy, worker)  # seq 1 prefilled: decoding from now on
    policy.add(make_seq(2, prompt_len=20, max_tokens=2))
    plans = [run_step(policy, worker)[0] for _ in range(3)]
    # Every step: seq 1 decodes first, seq 2 gets the 8-token budget (8 + 8 + 4).
    assert [[(s, len(toks), nc) for s, toks, nc in fed] for fed in worker.fed[1:4]] == [
        [(1, 1, 3), (2, 8, 0)], [(1, 1, 4), (2, 8, 8)], [(1, 1, 5), (2, 4, 16)]]
    assert [[e.is_sampling for e in p.scheduled] for p in plans] == [[True, False], [True, False], [True, True]]
    run_to_end(policy, worker)
    assert policy.num_free_blocks == 100


def test_batch_limit_caps_decodes_and_prefills_together():
    policy = make_policy(max_batch_size=2)
    worker = FakeWorker(policy=policy)
    for i in range(1, 4):
        policy.add(make_seq(i, max_tokens=3))
    plans = [run_step(policy, worker)[0] for _ in range(2)]
    assert all(p.batch_size <= 2 for p in plans)
    run_to_end(policy, worker)
    assert policy.num_free_blocks == 100


def test_repeated_prompt_reuses_full_blocks_and_reports_cached_tokens():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    policy.add(make_seq(1, prompt_len=11, max_tokens=2))
    first = run_to_end(policy, worker)[1]
    again = make_seq(2, prompt_len=11, max_tokens=2)
    assert policy.num_cached_prefix_tokens(again) == 8
    policy.add(again)
    plan, _ = run_step(policy, worker)
    assert worker.fed[-1] == [(2, list(range(18, 21)), 8)]  # only the tail is computed
    assert again.num_cached_tokens == 8 and policy.num_cached_tokens == 8
    assert run_to_end(policy, worker)[2] == first[1:]  # the same text, read through shared blocks
    assert [again.output_token_ids] == [first]
    assert policy.num_free_blocks == 100


def test_multi_turn_second_turn_reuses_the_first_turn_and_its_answer():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    turn1 = make_seq(1, prompt_len=9, max_tokens=6)
    policy.add(turn1)
    run_to_end(policy, worker)
    history = turn1.prompt_token_ids + turn1.output_token_ids  # 15 tokens, 12 computed in full blocks
    turn2 = make_seq(2, prompt_len=1, max_tokens=2)
    turn2.prompt_token_ids = history + [40, 41, 42]
    policy.add(turn2)
    run_step(policy, worker)
    assert turn2.num_cached_tokens == 12


def test_penalised_sequences_do_not_reuse_the_cache():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    policy.add(make_seq(1, prompt_len=9, max_tokens=1))
    run_to_end(policy, worker)
    penalised = make_seq(2, prompt_len=9, max_tokens=1)
    penalised.sampling = SamplingParams(frequency_penalty=0.5)
    policy.add(penalised)
    run_step(policy, worker)
    assert worker.fed[-1][0][2] == 0 and penalised.num_cached_tokens == 0


def test_out_of_blocks_preempts_the_newest_and_recomputes_to_the_same_text():
    # 6 blocks of 4 = 24 tokens; three sequences of 6 + 10 tokens cannot all stay.
    policy = make_policy(num_blocks=6)
    worker = FakeWorker(policy=policy)
    for i in range(1, 4):
        policy.add(make_seq(i, prompt_len=6, max_tokens=10, arrival_us=1_000 + i))
    outputs = run_to_end(policy, worker)
    assert policy.num_preemptions > 0
    for i in range(1, 4):
        assert outputs[i] == solo_text(6, 10, i), i
    assert policy.num_free_blocks == 6
    # Every preemption released the worker's state and sent a fresh first step.
    assert worker.num_first_steps == 3 + policy.num_preemptions


def test_partial_prompts_holding_every_block_do_not_deadlock():
    policy = make_policy(num_blocks=6, max_prefill_tokens=4)
    worker = FakeWorker(policy=policy)
    for i in range(1, 4):
        policy.add(make_seq(i, prompt_len=16, max_tokens=2))
    outputs = run_to_end(policy, worker)
    assert sorted(outputs) == [1, 2, 3] and policy.num_free_blocks == 6


@pytest.mark.parametrize("speculation", [None, SpeculationConfig("prompt_lookup", 4, 12),
                                         SpeculationConfig("suffix", 6, 12)], ids=["off", "lookup", "suffix"])
def test_no_block_leaks_after_any_mix_of_finish_cancel_preempt_and_error(speculation):
    """With speculation too: drafts kept whole, in part or not at all (the worker's
    text mostly repeats itself), under preemption, cancel and worker errors."""
    rng = random.Random(1234)
    drafted = accepted = 0
    for trial in range(40):
        num_blocks = rng.randint(6, 20)
        policy = make_policy(num_blocks=num_blocks, max_batch_size=rng.randint(1, 6),
                             max_prefill_tokens=rng.randint(1, 16), speculation=speculation)
        worker = FakeWorker(policy=policy, copy_period=3 if speculation else None)
        live, next_id = [], 1
        for _ in range(rng.randint(10, 60)):
            if rng.random() < 0.5:
                shared = [10] * rng.choice([0, 4, 8])  # some prompts share a prefix
                seq = make_seq(next_id, prompt_len=rng.randint(1, 12), max_tokens=rng.randint(1, 8))
                seq.prompt_token_ids = shared + seq.prompt_token_ids
                next_id += 1
                try:
                    policy.add(seq)
                    live.append(seq)
                except ValueError:
                    pass
            if live and rng.random() < 0.15:
                policy.finish(rng.choice(live), FinishReason.ABORT)  # cancel, waiting or running
            if rng.random() < 0.03:  # the worker failed: every sequence ends
                for seq in list(policy.running) + list(policy.waiting):
                    policy.finish(seq, FinishReason.ABORT)
                policy.forget_worker_state()
                worker.computed.clear()
            run_step(policy, worker)
        run_to_end(policy, worker)
        assert policy.num_free_blocks == num_blocks, trial
        assert all(b.ref_count == 0 for b in policy.blocks.blocks), trial
        assert not policy.running and not policy.waiting
        drafted += policy.speculator.num_draft_tokens
        accepted += policy.speculator.num_accepted_tokens
    assert (0 < accepted < drafted) if speculation else drafted == 0
