"""Batching policy on a fake worker: admission, continuous batching, accounting."""
from __future__ import annotations

import math

import pytest

from services.scheduler.plan import SteadyDecodes, StepPlan
from services.scheduler.policy import BatchPolicy, CapacityError, SampledToken, WorkerCapacity
from services.scheduler.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    StoppingCriteria,
    ThinkingBudget,
)
from services.scheduler.speculation import Speculator

EOS = 2
BLOCK_SIZE = 4


def make_policy(num_blocks=100, block_size=BLOCK_SIZE, max_batch_size=8, max_prefill_tokens=1000, speculation=None,
                speculator=None, decode_steps=1):
    capacity = WorkerCapacity(num_kv_blocks=num_blocks, block_size=block_size, max_batch_size=64,
                              eos_token_ids=frozenset({EOS}), holds_block_tables=True, max_decode_steps=64)
    if speculation is not None:
        speculator = Speculator(speculation)
    return BatchPolicy(capacity, max_batch_size, max_prefill_tokens, speculator, decode_steps)


def make_seq(seq_id, prompt_len=5, max_tokens=4, arrival_us=1_000, **stopping):
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(range(10, 10 + prompt_len)),
                    sampling=SamplingParams(), stopping=StoppingCriteria(max_tokens=max_tokens, **stopping),
                    arrival_us=arrival_us)


class FakeWorker:
    """Stands in for the worker: keeps "KV" (the token at each slot) in a pool read and
    written only through the block tables it is sent, and samples either a fixed token
    or one derived from the whole context it reads back and the seed — so a wrong
    table, a wrong num_computed_tokens or a write into a shared block changes the text
    or fails. Logprobs (when asked) are a function of the token. With `copy_period`
    the text mostly repeats itself (the token that many positions back), as text a
    draft can guess. A drafted step is verified as on the real worker: a token is
    sampled after every fed token from the last known one on, and the drafts are
    kept up to the first that differs from its position's sample."""

    def __init__(self, token=None, policy=None, copy_period=None):
        self.token = token
        self.copy_period = copy_period
        self.policy = policy
        self.slots: dict[int, int] = {}
        self.computed: dict[int, int] = {}  # seq_id -> tokens the worker holds
        self.last_sampled: dict[int, int] = {}  # seq_id -> token sampled and not fed yet
        self.tables: dict[int, list[int]] = {}  # seq_id -> the block table as the worker holds it
        self.fed: list[list[tuple[int, list[int], int]]] = []
        self.released: list[int] = []
        self.num_first_steps = 0

    def step(self, plan):
        steady = [(seq, self.computed[seq.seq_id], block) for seq, block in zip(plan.steady.seqs, plan.steady.new_blocks)]
        self.fed.append([(e.seq.seq_id, e.token_ids, e.num_computed_tokens) for e in plan.scheduled]
                        + [(seq.seq_id, [], computed) for seq, computed, _ in steady])
        self.released.extend(plan.release_seq_ids)
        for seq_id in plan.release_seq_ids:
            self.computed.pop(seq_id, None)
            self.last_sampled.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        copied = {
            dst * BLOCK_SIZE + o: self.slots.get(src * BLOCK_SIZE + o)
            for src, dst in plan.block_copies for o in range(BLOCK_SIZE)
        }  # every source read before any destination is written, as on the worker
        for slot, token in copied.items():
            if token is None:
                self.slots.pop(slot, None)
            else:
                self.slots[slot] = token
        sampled = {}
        # Every part as (seq, computed, new tokens, drafts, sampling, the block its held table gains or None).
        parts = []
        for e in plan.scheduled:
            seq = e.seq
            if seq.seq_id in self.computed:
                assert e.num_computed_tokens == self.computed[seq.seq_id]
                assert not e.sends_sampling
            else:
                assert e.sends_sampling, "sampling must come with a first step"
                self.num_first_steps += 1
            token_ids = e.token_ids
            if e.feeds_last_sampled:
                assert not token_ids and e.is_sampling
                token_ids = [self.last_sampled[seq.seq_id]]
            parts.append((seq, e.num_computed_tokens, token_ids, list(e.draft_token_ids), e.is_sampling,
                          e.extends_table))
        for seq, computed, block in steady:  # decodes by id: the token sampled last, on the table held
            parts.append((seq, computed, [self.last_sampled[seq.seq_id]], [], True, block))
        for seq, start, token_ids, draft, is_sampling, new_block in parts:
            if new_block is None:  # the table sent whole
                table = self.tables[seq.seq_id] = list(seq.block_table)
            else:
                table = self.tables[seq.seq_id]
                if new_block >= 0:
                    table.append(new_block)
            end = start + len(token_ids)
            assert len(table) * BLOCK_SIZE >= end
            self.last_sampled.pop(seq.seq_id, None)
            for position, token in enumerate(token_ids, start=start):
                block = table[position // BLOCK_SIZE]
                if self.policy is not None:
                    assert self.policy.blocks.blocks[block].ref_count == 1, "write into a shared block"
                self.slots[block * BLOCK_SIZE + position % BLOCK_SIZE] = token
            end -= len(draft)
            self.computed[seq.seq_id] = end
            if is_sampling:
                context = [self.slots[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] for p in range(end)]
                token = self.next_token(context, seq.sampling.seed)
                kept = 0
                while kept < len(draft) and token == draft[kept]:  # read back from the KV written
                    context.append(self.slots[table[end // BLOCK_SIZE] * BLOCK_SIZE + end % BLOCK_SIZE])
                    end, kept = end + 1, kept + 1
                    token = self.next_token(context, seq.sampling.seed)
                self.computed[seq.seq_id] = end
                if draft:
                    sampled[seq.seq_id] = SampledToken(seq.seq_id, token, num_accepted_draft_tokens=kept)
                    self.last_sampled[seq.seq_id] = token
                    continue
                mixed = sum((i + 1) * t for i, t in enumerate(context)) + seq.sampling.seed
                logprob = -0.1 - (token % 7) / 4 if seq.sampling.top_logprobs >= 0 else None
                alternatives = ()
                if seq.sampling.top_logprobs > 0:  # greedy over a distribution of the context
                    alternatives = tuple(distribution(context)[: seq.sampling.top_logprobs])
                    token, logprob = alternatives[0]
                sampled[seq.seq_id] = SampledToken(seq.seq_id, token, logprob, alternatives) \
                    if logprob is not None else token  # a plain token as its id, as the worker answers it
                self.last_sampled[seq.seq_id] = token
        return sampled

    def answer(self, plan) -> tuple[dict, list[int] | None]:
        """Run a planned message as the worker does (StepRequest.decode_steps):
        its first step, then its steady decodes alone in each step after it;
        the tokens by id and, for several steps, the steady ones step after step."""
        sampled = self.step(plan)
        steady = plan.steady
        if steady.steps == 1:
            return sampled, None
        assert not plan.scheduled, "several steps are of steady decodes alone"
        tokens = [sampled[i] for i in steady.seq_ids]
        later = StepPlan(plan.step_id, [], steady=SteadyDecodes(steady.seqs, steady.seq_ids, [-1] * len(steady.seqs)))
        for _ in range(steady.steps - 1):
            sampled = self.step(later)
            tokens += [sampled[i] for i in steady.seq_ids]
        return {}, tokens

    def next_token(self, context: list[int], seed: int) -> int:
        # The seed picks the "random" stream, as on the real worker.
        mixed = sum((i + 1) * t for i, t in enumerate(context)) + seed
        if self.token is not None:
            return self.token
        if self.copy_period is not None and len(context) >= self.copy_period and mixed % 5:
            return context[-self.copy_period]
        return 10 + mixed % 37


def distribution(context: list[int]) -> list[tuple[int, float]]:
    """A fixed next-token distribution over tokens 2..21 (EOS included) for a context:
    (token, logprob), best first."""
    weights = [((sum((i + 7) * t for i, t in enumerate(context)) * 2654435761 + token * 40503) % 1009) / 97
               for token in range(2, 22)]
    norm = math.log(sum(math.exp(w) for w in weights))
    return sorted(((token, w - norm) for token, w in zip(range(2, 22), weights)), key=lambda tw: -tw[1])


def run_step(policy, worker, started=2_000, finished=3_000):
    plan = policy.schedule()
    if plan is None:
        return None, []
    return plan, policy.postprocess(plan, worker.step(plan), started, finished)


def test_prefill_then_decode_feeds_the_right_tokens():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(1, prompt_len=3, max_tokens=3))
    run_step(policy, worker)
    run_step(policy, worker)
    assert worker.fed[0] == [(1, [10, 11, 12], 0)]
    assert worker.fed[1] == [(1, [7], 3)]


def test_new_request_joins_running_batch_between_steps():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(1, max_tokens=10))
    run_step(policy, worker)
    policy.add(make_seq(2, max_tokens=10))
    plan, _ = run_step(policy, worker)
    assert [s.seq_id for s in plan.sequences] == [1, 2]
    assert plan.batch_size == 2


def test_finished_sequence_leaves_and_is_released():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(1, max_tokens=1))
    policy.add(make_seq(2, max_tokens=3))
    _, events = run_step(policy, worker)
    done = {seq.seq_id: seq.finish_reason for seq, _ in events if seq.is_finished}
    assert done == {1: FinishReason.LENGTH}
    plan, _ = run_step(policy, worker)
    assert [s.seq_id for s in plan.sequences] == [2]
    assert plan.release_seq_ids == [1]


def test_eos_stops_unless_ignored_and_stop_token_ids_stop():
    policy, worker = make_policy(), FakeWorker(token=EOS)
    policy.add(make_seq(1, max_tokens=5))
    policy.add(make_seq(2, max_tokens=5, ignore_eos=True))
    _, events = run_step(policy, worker)
    by_id = {seq.seq_id: seq for seq, _ in events}
    assert by_id[1].finish_reason is FinishReason.STOP and by_id[1].ended_by_stop_token
    assert not by_id[2].is_finished

    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(3, max_tokens=5, stop_token_ids=frozenset({7})))
    _, events = run_step(policy, worker)
    assert events[0][0].finish_reason is FinishReason.STOP


def test_batch_limit_and_fcfs_order():
    policy, worker = make_policy(max_batch_size=2), FakeWorker()
    for i in range(1, 5):
        policy.add(make_seq(i, max_tokens=2))
    plan, _ = run_step(policy, worker)
    assert [s.seq_id for s in plan.sequences] == [1, 2]
    assert [s.seq_id for s in policy.waiting] == [3, 4]


def test_prefill_token_budget_admits_at_least_one():
    policy, worker = make_policy(max_prefill_tokens=8), FakeWorker()
    policy.add(make_seq(1, prompt_len=20))
    policy.add(make_seq(2, prompt_len=5))
    plan, _ = run_step(policy, worker)
    assert [s.seq_id for s in plan.sequences] == [1]


def test_blocks_are_taken_on_demand_and_all_return():
    # 10 blocks of 4: four prompts of 5 tokens take 2 blocks each up front, then grow.
    policy, worker = make_policy(num_blocks=10), FakeWorker(token=7)
    for i in range(1, 5):
        policy.add(make_seq(i, prompt_len=5, max_tokens=7))
    plan, _ = run_step(policy, worker)
    assert len(plan.sequences) == 4 and policy.num_free_blocks == 2
    while policy.has_work():
        run_step(policy, worker)
    assert policy.num_free_blocks == 10
    assert set(worker.released) == {1, 2, 3, 4}


def test_request_that_can_never_fit_is_rejected_up_front():
    policy = make_policy(num_blocks=2, block_size=4)
    with pytest.raises(CapacityError):
        policy.add(make_seq(1, prompt_len=5, max_tokens=4))


def test_abort_waiting_and_running_frees_everything():
    policy, worker = make_policy(num_blocks=4, block_size=4), FakeWorker(token=7)
    policy.add(make_seq(1, max_tokens=3))
    policy.add(make_seq(2, max_tokens=3))  # 2 + 2 blocks: both run
    policy.add(make_seq(3, max_tokens=3))  # no block left for it yet
    run_step(policy, worker)
    waiting, running = policy.waiting[0], policy.running[0]
    policy.finish(waiting, FinishReason.ABORT)
    policy.finish(running, FinishReason.ABORT)
    assert waiting.status is SequenceStatus.FINISHED and not policy.waiting
    while policy.has_work():
        run_step(policy, worker)
    assert policy.num_free_blocks == 4
    assert sorted(worker.released) == [1, 2]


def test_abort_during_step_is_skipped_and_released():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(1, max_tokens=5))
    plan = policy.schedule()
    sampled = worker.step(plan)
    policy.finish(plan.sequences[0], FinishReason.ABORT)  # the client left mid-step
    events = policy.postprocess(plan, sampled, 0, 1)
    assert events == []
    plan = policy.schedule()
    assert plan.sequences == [] and plan.release_seq_ids == [1]


def test_per_token_statistics():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(make_seq(1, arrival_us=1_000, max_tokens=5))
    policy.add(make_seq(2, arrival_us=1_500, max_tokens=5))
    _, events = run_step(policy, worker, started=2_000, finished=12_000)
    assert [(e.batch_size, e.queue_wait_us, e.latency_ms) for _, e in events] == [(2, 1000, 11.0), (2, 500, 10.5)]
    _, events = run_step(policy, worker, started=12_400, finished=20_000)
    assert [(e.queue_wait_us, e.latency_ms) for _, e in events] == [(400, 8.0), (400, 8.0)]


THINK_END = (90, 91)  # a two-token closing marker
EARLY_STOP = (80, 81, 90, 91)


def budgeted(seq_id, budget, max_tokens=20):
    return make_seq(seq_id, max_tokens=max_tokens,
                    thinking_budget=ThinkingBudget(budget, THINK_END, EARLY_STOP))


def test_spent_thinking_budget_appends_the_early_stop_tokens_and_goes_on():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(budgeted(1, budget=3))
    emitted = []
    for _ in range(5):
        _, events = run_step(policy, worker)
        emitted += [event.token_id for _, event in events]
    # Three sampled tokens, then the early-stop text as output, then sampling goes on.
    assert emitted[:8] == [7, 7, 7, *EARLY_STOP, 7]
    # The appended tokens are computed in one chunk that ends by sampling, like a prompt's tail.
    assert worker.fed[3] == [(1, [7, *EARLY_STOP], 7)]
    seq = events[0][0]
    assert seq.output_token_ids[:7] == [7, 7, 7, *EARLY_STOP] and seq.is_thinking_done


def test_a_think_block_closed_by_the_model_spends_no_budget():
    policy = make_policy()
    tokens = iter([5, *THINK_END, 6, 6, 6, 6, 6])

    class Scripted(FakeWorker):
        def step(self, plan):
            return {s: SampledToken(s, next(tokens)) for s in super().step(plan)}

    policy.add(budgeted(1, budget=4))
    worker = Scripted(token=0)
    emitted = []
    for _ in range(7):
        emitted += [event.token_id for _, event in run_step(policy, worker)[1]]
    assert emitted == [5, *THINK_END, 6, 6, 6, 6]


def test_early_stop_tokens_are_cut_at_max_tokens():
    policy, worker = make_policy(), FakeWorker(token=7)
    policy.add(budgeted(1, budget=2, max_tokens=4))
    emitted = []
    for _ in range(2):
        emitted += [event.token_id for _, event in run_step(policy, worker)[1]]
    assert emitted == [7, 7, *EARLY_STOP[:2]]
    plan, events = run_step(policy, worker)
    assert plan is not None and plan.scheduled == [] and plan.release_seq_ids == [1]


def test_a_sink_takes_the_middle_tokens_and_the_last_one_is_delivered():
    policy, worker = make_policy(), FakeWorker(token=7)
    seq = make_seq(1, arrival_us=1_000, max_tokens=4)
    policy.add(seq)
    taken, accepts = [], [True]

    def sink(token_id, shared):
        if accepts[0]:
            taken.append((token_id, *shared))
        return accepts[0]

    def step(started, finished):
        plan = policy.schedule()
        return [(s.seq_id, e.token_id, e.latency_ms)
                for s, e in policy.postprocess(plan, worker.step(plan), started, finished)]

    assert step(2_000, 12_000) == [(1, 7, 11.0)]  # the first token, before the server sets the sink
    seq.sink = sink
    assert step(12_400, 20_000) == [] and taken == [(7, 1, 400, 8.0)] and policy.packed_stats == {(1, 400, 8.0): 1}
    accepts[0] = False  # the stream's message has an event of this call already
    assert step(20_000, 21_000) == [(1, 7, 1.0)] and policy.packed_stats == {}
    accepts[0] = True
    assert step(21_000, 23_000) == [(1, 7, 2.0)] and len(taken) == 1  # the last token carries the finish reason
    assert seq.is_finished and seq.output_token_ids == [7, 7, 7, 7]
