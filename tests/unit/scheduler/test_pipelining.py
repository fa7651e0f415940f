"""Planning one step ahead (as EngineLoop does: step N+1 is planned and sent before
step N's answer is accounted for) on the fake worker: every request gets exactly
the tokens it gets without planning ahead, through chunked prefill, siblings,
beam search, thinking budgets, stop tokens, preemption and aborts, and nothing
leaks."""
from __future__ import annotations

import random
from collections import deque

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequences
from services.scheduler.sequence import FinishReason, SamplingParams, ThinkingBudget
from stormserve.scheduler.v1 import scheduler_pb2
from tests.unit.scheduler.test_batching import run_to_end
from tests.unit.scheduler.test_policy import FakeWorker, make_policy, make_seq
from tests.unit.scheduler.test_siblings import assert_no_leak


def run_ahead(policy, worker, max_steps=10_000, on_step=None, on_answer=None) -> dict[int, list[int]]:
    """Drive the policy as EngineLoop does; the fake worker runs each step when sent."""
    outputs: dict[int, list[int]] = {}
    sent: deque = deque()
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, policy)
        plan = policy.schedule() if len(sent) < 2 else None
        if plan is not None:
            sent.append((plan, worker.answer(plan)))
            if len(sent) < 2:
                continue
        if not sent:
            assert not policy.has_work(), "the policy stopped making progress"
            return outputs
        plan, (sampled, steady_tokens) = sent.popleft()
        if on_answer is not None:
            on_answer(plan)
        for seq, event in policy.postprocess(plan, sampled, 2_000, 3_000, steady_tokens):
            outputs.setdefault(seq.seq_id, []).append(event.token_id)
    raise AssertionError("too many steps")


def requests(rng: random.Random, num_blocks: int, longest: int = 8):
    """A random mix of requests that each fit `num_blocks` blocks of 4 alone, of
    1 to `longest` tokens; built afresh on each call from the same rng state."""
    seqs, groups = [], []
    next_id = 1
    for _ in range(rng.randint(1, 8)):
        kind = rng.choice(["plain", "stop", "siblings", "beam", "budget"])
        prompt_len, max_tokens = rng.randint(1, 10), rng.randint(1, longest)
        max_tokens = min(max_tokens, num_blocks * 4 - prompt_len)
        if kind == "beam":  # its 3 beams must fit at once
            max_tokens = min(max_tokens, num_blocks // 3 * 4 - 1)
            prompt_len = min(prompt_len, num_blocks // 3 * 4 - max_tokens)
        prompt = [rng.randint(10, 46) for _ in range(prompt_len)]  # distinct prompts: no prefix sharing
        if kind == "beam":
            request = scheduler_pb2.GenerateRequest(
                request_id=f"b{next_id}", prompt_token_ids=prompt, use_beam_search=True,
                n=rng.randint(1, 2), best_of=3, stopping=scheduler_pb2.StoppingCriteria(max_tokens=max_tokens))
            ids = iter(range(1000 * next_id, 1000 * next_id + 999))
            results, _ = to_sequences(request, lambda ids=ids: next(ids), SchedulerConfig(max_batch_size=8), 1_000)
            groups.append(results)
            next_id += 1
            continue
        if kind == "siblings":
            group = []
            for i in range(rng.randint(2, 3)):
                seq = make_seq(next_id, prompt_len=prompt_len, max_tokens=max_tokens)
                seq.sampling, seq.index = SamplingParams(seed=100 + i, top_logprobs=0), i
                seq.prompt_token_ids = list(prompt)
                group.append(seq)
                next_id += 1
            groups.append(group)
            continue
        extra = {}
        if kind == "stop":
            extra["stop_token_ids"] = frozenset(range(10, 47, 5))
        if kind == "budget":
            extra["thinking_budget"] = ThinkingBudget(2, (99,), (97, 99))
        seqs.append(make_seq(next_id, prompt_len=prompt_len, max_tokens=max_tokens, **extra))
        seqs[-1].prompt_token_ids = prompt
        next_id += 1
    return seqs + [s for g in groups for s in g], [[s] for s in seqs] + groups


@pytest.mark.parametrize("seed", range(40))
def test_planning_ahead_gives_the_same_tokens(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 12, 200])  # small pools preempt
    max_prefill = rng.choice([4, 16, 1000])
    results = []
    for ahead in (False, True):
        policy = make_policy(num_blocks=num_blocks, max_prefill_tokens=max_prefill)
        worker = FakeWorker(policy=policy)
        every, groups = requests(random.Random(seed), num_blocks)
        for group in groups:
            policy.add_group(group)
        outputs = (run_ahead if ahead else run_to_end)(policy, worker)
        results.append(({s.seq_id: (s.output_token_ids, s.finish_reason) for s in every}, outputs))
        assert_no_leak(policy)
        assert all(s.is_finished for s in every)
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1]  # the same tokens delivered too


def test_a_decoding_sequence_feeds_the_token_in_flight():
    policy = make_policy()
    worker = FakeWorker(policy=policy)
    seq = make_seq(1, prompt_len=5, max_tokens=6)
    policy.add(seq)
    run_ahead(policy, worker)
    # Prefill, then five decodes, each planned while the step before it ran (then a
    # step that only releases it).
    assert [[(tokens, computed) for _, tokens, computed in fed] for fed in worker.fed] == [
        [(list(range(10, 15)), 0)], *[[([], 5 + i)] for i in range(5)], []]
    assert len(seq.output_token_ids) == 6 and assert_no_leak(policy) is None


def test_a_stop_token_costs_one_wasted_step_and_nothing_else():
    policy = make_policy()
    worker = FakeWorker(token=7, policy=policy)
    seq = make_seq(1, prompt_len=3, max_tokens=10, stop_token_ids=frozenset({7}))
    other = make_seq(2, prompt_len=3, max_tokens=4)
    policy.add(seq)
    policy.add(other)
    outputs = run_ahead(policy, worker)
    assert outputs[1] == [7] and seq.finish_reason is FinishReason.STOP
    assert [s for s, _, _ in worker.fed[1]] == [1, 2]  # planned before the stop token was seen
    assert all(1 not in [s for s, _, _ in fed] for fed in worker.fed[2:])
    assert 1 in worker.released
    assert_no_leak(policy)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_abort_while_two_steps_are_planned_leaks_nothing(decode_steps):
    policy = make_policy(decode_steps=decode_steps)
    worker = FakeWorker(policy=policy)
    seqs = [make_seq(i, prompt_len=6, max_tokens=30) for i in (1, 2, 3)]
    for seq in seqs:
        policy.add(seq)

    answered = []

    def abort_some(step, policy):
        if step == 5 if decode_steps == 1 else answered.count(4) == 2 and not seqs[1].is_finished:
            policy.finish(seqs[1], FinishReason.ABORT)  # four-step messages: aborted under the ones in flight

    outputs = run_ahead(policy, worker, on_step=abort_some, on_answer=lambda plan: answered.append(plan.steady.steps))
    assert seqs[1].finish_reason is FinishReason.ABORT and len(outputs[2]) < 30
    assert len(outputs[1]) == len(outputs[3]) == 30
    assert_no_leak(policy)


@pytest.mark.parametrize("seed", range(30))
def test_several_decode_steps_a_message_give_the_same_tokens(seed):
    """Messages of several steps (StepRequest.decode_steps) where every running
    sequence decodes steadily: the same tokens and finish reasons as one step a
    message, through stop tokens inside a message, max_tokens, preemption in
    small pools, siblings, beams and thinking budgets; tables always long
    enough (the fake worker checks), and nothing leaks."""
    rng = random.Random(seed)
    num_blocks, max_prefill, decode_steps = rng.choice([8, 12, 200]), rng.choice([4, 16, 1000]), rng.choice([2, 3, 4])
    results, multi_step = [], []
    for steps in (1, decode_steps):
        policy = make_policy(num_blocks=num_blocks, max_prefill_tokens=max_prefill, decode_steps=steps)
        worker = FakeWorker(policy=policy)
        every, groups = requests(random.Random(seed), num_blocks, longest=40)
        for group in groups:
            policy.add_group(group)
        answered = []
        outputs = run_ahead(policy, worker, on_answer=lambda plan: answered.append(plan.steady.steps))
        results.append(({s.seq_id: (s.output_token_ids, s.finish_reason) for s in every}, outputs))
        assert_no_leak(policy)
        assert all(s.is_finished for s in every)
        multi_step.append(sum(n > 1 for n in answered))
    assert results[0] == results[1]
    assert multi_step[0] == 0 and set(answered) <= set(range(1, decode_steps + 1))


class CountingWorker(FakeWorker):
    """Samples 100 + the context's length: a sequence's n-th output is known."""

    def next_token(self, context, seed):
        return 100 + len(context)


def test_messages_of_several_steps_run_while_nothing_waits_and_stop_inside_one():
    policy = make_policy(decode_steps=4)
    worker = CountingWorker(policy=policy)
    stopping = make_seq(1, prompt_len=5, max_tokens=40, stop_token_ids=frozenset({100 + 5 + 9}))
    long = make_seq(2, prompt_len=6, max_tokens=60)
    policy.add(stopping)
    policy.add(long)
    answered = []
    late = make_seq(3, prompt_len=3, max_tokens=3)

    def arrive(step, policy):
        if step == 8:  # a request that comes in while messages of four steps are in flight
            policy.add(late)
            answered.append("arrived")

    outputs = run_ahead(policy, worker, on_step=arrive, on_answer=lambda plan: answered.append(
        (plan.steady.steps, sorted(s.seq_id for s in plan.sequences))))
    # Its 10th token stops it: the tokens the worker sampled after it, in the same message, are dropped.
    assert stopping.output_token_ids == outputs[1] == list(range(105, 115))
    assert stopping.finish_reason is FinishReason.STOP
    assert long.output_token_ids == outputs[2] == list(range(106, 166)) and long.finish_reason is FinishReason.LENGTH
    assert outputs[3] == [103, 104, 105]
    arrived = answered.index("arrived")
    before, after = answered[:arrived], answered[arrived + 1:]
    assert (4, [1, 2]) in before
    # The newcomer waited for the two messages in flight at most, then steps of one until it decoded steadily too.
    first = next(i for i, (_, seqs) in enumerate(after) if 3 in seqs)
    assert first <= 2 and after[first][0] == 1
    assert all(steps == 1 for steps, seqs in after if 3 in seqs)
    assert any(steps == 4 for steps, _ in after[first:])  # when it is done, the others go on four at a time
    assert_no_leak(policy)


@pytest.mark.parametrize("decode_steps", [2, 3, 4])
def test_messages_of_several_steps_end_every_sequence_at_its_max_tokens(decode_steps):
    """Whatever a sequence's max_tokens, against how far the messages in flight
    and planned reach: its last token is planned and accounted alone, never
    past max_tokens (a member that leaves the steady set near its end does not
    join it again while a message of several steps is in flight)."""
    for longest in range(8, 44, 3):
        policy = make_policy(decode_steps=decode_steps)
        worker = CountingWorker(policy=policy)
        seqs = [make_seq(i, prompt_len=5 + i, max_tokens=longest - i) for i in range(3)]
        for seq in seqs:
            policy.add(seq)
        answered = []
        outputs = run_ahead(policy, worker, on_answer=lambda plan: answered.append(plan.steady.steps))
        for seq in seqs:
            assert outputs[seq.seq_id] == seq.output_token_ids == list(
                range(100 + seq.num_prompt_tokens, 100 + seq.num_prompt_tokens + seq.stopping.max_tokens)), longest
            assert seq.finish_reason is FinishReason.LENGTH
        assert decode_steps in answered or longest < 20
        assert_no_leak(policy)
