"""Several sequences per request on the fake worker: the prompt is prefilled once and
its full blocks shared by reference count; shared blocks are freed exactly once,
with no leak after any mix of finish, cancel, preemption and worker error."""
from __future__ import annotations

import random

from services.scheduler.policy import BatchPolicy
from services.scheduler.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tests.unit.scheduler.test_batching import run_to_end
from tests.unit.scheduler.test_policy import BLOCK_SIZE, FakeWorker, make_policy, make_seq, run_step


def make_group(first_id: int, n: int, prompt_len: int = 11, max_tokens: int = 4, **sampling) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = make_seq(first_id + i, prompt_len=prompt_len, max_tokens=max_tokens)
        seq.sampling, seq.index = SamplingParams(seed=1000 + i, **sampling), i
        seqs.append(seq)
    return seqs


def solo_output(seq: Sequence) -> list[int]:
    """What the sequence generates alone, prefilling its whole prompt itself."""
    policy = make_policy()
    alone = make_seq(seq.seq_id, prompt_len=seq.num_prompt_tokens, max_tokens=seq.stopping.max_tokens)
    alone.sampling = seq.sampling
    policy.add(alone)
    run_to_end(policy, FakeWorker(policy=policy))
    return alone.output_token_ids


def assert_no_leak(policy: BatchPolicy) -> None:
    assert policy.num_free_blocks == policy.capacity.num_kv_blocks
    assert all(b.ref_count == 0 for b in policy.blocks.blocks)
    assert not policy.unfinished_sequences()


def test_prompt_is_prefilled_once_and_siblings_compute_only_the_tail():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    leader, *siblings = make_group(1, 3, prompt_len=11)
    policy.add_group([leader, *siblings])
    assert policy.num_unfinished == 3 and [s.seq_id for s in policy.waiting] == [1]
    run_step(policy, worker)
    assert worker.fed[0] == [(1, list(range(10, 21)), 0)]  # the leader alone prefills
    shared = leader.block_table[:2]  # 11 tokens: two full blocks before the last token
    assert all(s.block_table == shared for s in siblings)
    assert [policy.blocks.blocks[b].ref_count for b in shared] == [3, 3]
    run_step(policy, worker)
    # The leader decodes; each sibling feeds the tail (3 tokens) after 8 shared ones.
    assert worker.fed[1] == [(1, [leader.output_token_ids[0]], 11), (2, [18, 19, 20], 8), (3, [18, 19, 20], 8)]
    assert [s.num_cached_tokens for s in siblings] == [8, 8]
    outputs = run_to_end(policy, worker)
    assert len({tuple(s.output_token_ids) for s in [leader, *siblings]}) == 3  # independent seeds
    for seq in [leader, *siblings]:  # shared KV reads back as the sequence's own
        assert seq.output_token_ids == solo_output(seq), seq.seq_id
    assert sorted(outputs) == [1, 2, 3]
    assert_no_leak(policy)


def test_fork_at_block_boundaries():
    for prompt_len, num_shared, tail in ((8, 1, 4), (9, 2, 1), (3, 0, 3)):
        policy = make_policy()
        worker = FakeWorker(policy=policy)
        group = make_group(1, 2, prompt_len=prompt_len)
        policy.add_group(group)
        run_step(policy, worker)
        run_step(policy, worker)
        fed = dict((seq_id, (len(tokens), computed)) for seq_id, tokens, computed in worker.fed[1])
        assert fed[2] == (tail, num_shared * BLOCK_SIZE), prompt_len
        run_to_end(policy, worker)
        assert group[1].output_token_ids == solo_output(group[1])
        assert_no_leak(policy)


def test_penalised_siblings_prefill_on_their_own():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    group = make_group(1, 2, prompt_len=9, frequency_penalty=0.5)
    policy.add_group(group)
    run_step(policy, worker)
    assert [(seq_id, computed) for seq_id, _, computed in worker.fed[0]] == [(1, 0), (2, 0)]
    run_to_end(policy, worker)
    assert_no_leak(policy)


def test_shared_blocks_are_freed_once_whichever_sibling_ends_first():
    policy = make_policy(num_blocks=20)
    worker = FakeWorker(policy=policy)
    leader, second, third = make_group(1, 3, prompt_len=11, max_tokens=6)
    policy.add_group([leader, second, third])
    run_step(policy, worker)
    run_step(policy, worker)
    shared = leader.block_table[:2]
    policy.finish(leader, FinishReason.ABORT)  # the leader goes first: its siblings keep the prompt
    assert [policy.blocks.blocks[b].ref_count for b in shared] == [2, 2]
    policy.finish(third, FinishReason.ABORT)
    assert [policy.blocks.blocks[b].ref_count for b in shared] == [1, 1]
    run_to_end(policy, worker)
    assert second.output_token_ids == solo_output(second)
    assert_no_leak(policy)


def test_leader_aborted_before_its_prompt_is_done_hands_over_to_a_sibling():
    policy = make_policy(max_prefill_tokens=4)
    worker = FakeWorker(policy=policy)
    leader, second, third = make_group(1, 3, prompt_len=11)
    policy.add_group([leader, second, third])
    run_step(policy, worker)  # a 4-token chunk: the prompt is not done
    policy.finish(leader, FinishReason.ABORT)
    assert policy.waiting[0] is second and second.forks == [third] and third.fork_of is second
    run_to_end(policy, worker)
    assert second.output_token_ids == solo_output(second) and third.output_token_ids == solo_output(third)
    assert third.num_cached_tokens == 8  # forked from the new leader
    assert_no_leak(policy)


def test_pending_sibling_cancelled_never_starts():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    leader, second = make_group(1, 2)
    policy.add_group([leader, second])
    policy.finish(second, FinishReason.ABORT)
    assert second.status is SequenceStatus.FINISHED and leader.forks == []
    run_to_end(policy, worker)
    assert {seq_id for fed in worker.fed for seq_id, _, _ in fed} == {1}
    assert_no_leak(policy)


def test_preempted_siblings_recompute_to_the_same_text():
    # 8 blocks of 4; four siblings of 11 + 12 tokens cannot all stay.
    policy = make_policy(num_blocks=8)
    worker = FakeWorker(policy=policy)
    group = make_group(1, 4, prompt_len=11, max_tokens=12)
    policy.add_group(group)
    run_to_end(policy, worker)
    assert policy.num_preemptions > 0
    for seq in group:
        assert seq.output_token_ids == solo_output(seq), seq.seq_id
        assert seq.finish_reason is FinishReason.LENGTH
    assert_no_leak(policy)


def test_no_block_leaks_with_sibling_groups_under_any_mix_of_events():
    rng = random.Random(4321)
    for trial in range(40):
        num_blocks = rng.randint(8, 24)
        policy = make_policy(num_blocks=num_blocks, max_batch_size=rng.randint(1, 6),
                             max_prefill_tokens=rng.randint(1, 16))
        worker = FakeWorker(policy=policy)
        live: list[Sequence] = []
        next_id = 1
        for _ in range(rng.randint(10, 50)):
            if rng.random() < 0.4:
                group = make_group(next_id, rng.randint(1, 4), prompt_len=rng.randint(1, 14),
                                   max_tokens=rng.randint(1, 8))
                next_id += len(group)
                try:
                    policy.add_group(group)
                    live.extend(group)
                except ValueError:
                    pass
            if live and rng.random() < 0.15:
                policy.finish(rng.choice(live), FinishReason.ABORT)  # pending, waiting or running
            if rng.random() < 0.03:  # the worker failed: every sequence ends
                for seq in policy.unfinished_sequences():
                    policy.finish(seq, FinishReason.ABORT)
                policy.forget_worker_state()
                worker.computed.clear()
            run_step(policy, worker)
        run_to_end(policy, worker)
        assert_no_leak(policy)
        assert all(seq.is_finished for seq in live), trial


def test_the_unfinished_count_follows_forks_aborts_preemptions_and_a_lost_worker():
    """num_unfinished is kept as a count (every placement reads it for every
    worker): it must equal the sequences unfinished_sequences() lists, siblings
    pending on their leader included, whatever happens to leaders and siblings."""
    rng = random.Random(37)
    for trial in range(30):
        policy = make_policy(num_blocks=rng.randint(8, 24), max_batch_size=rng.randint(1, 6),
                             max_prefill_tokens=rng.randint(2, 16))
        worker = FakeWorker(policy=policy)
        live: list[Sequence] = []
        next_id = 1

        def check() -> None:
            assert policy.num_unfinished == len(policy.unfinished_sequences()), trial

        for _ in range(rng.randint(10, 40)):
            if rng.random() < 0.4:
                group = make_group(next_id, rng.randint(1, 4), prompt_len=rng.randint(1, 12),
                                   max_tokens=rng.randint(1, 6))
                next_id += len(group)
                try:
                    policy.add_group(group)
                    live += group
                except ValueError:
                    pass
                check()
            if live and rng.random() < 0.25:  # a leader, a pending sibling, a running one
                policy.finish(rng.choice(live), FinishReason.ABORT)
                check()
            if rng.random() < 0.03:  # the worker was lost
                for seq in policy.unfinished_sequences():
                    policy.finish(seq, FinishReason.ABORT)
                policy.forget_worker_state()
                worker.computed.clear()
                check()
            run_step(policy, worker)
            check()
        run_to_end(policy, worker)
        check()
        assert policy.num_unfinished == 0
