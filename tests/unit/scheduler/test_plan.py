"""What the policy and the worker client exchange: a planned sequence's input
tokens, the Step message built in place, and the sampled tokens read back."""
from __future__ import annotations

import pytest

from services.scheduler.plan import SampledToken, ScheduledSequence, StepPlan
from services.scheduler.sequence import SamplingParams, Sequence
from services.scheduler.worker_client import host_of, sampled_tokens, step_request
from stormserve.worker.v1 import worker_pb2
from tests.unit.scheduler.test_policy import make_seq


def test_token_ids_are_the_window_of_prompt_and_outputs_with_the_draft_after():
    seq = make_seq(1, prompt_len=5)
    seq.output_token_ids = [50, 51, 52]
    every = seq.all_token_ids
    for start in range(len(every)):
        for num_known in range(1, len(every) - start + 1):
            for draft in ((), (7, 8)):
                entry = ScheduledSequence(seq, start, num_known + len(draft), draft_token_ids=draft)
                assert entry.token_ids == every[start : start + num_known] + list(draft)
    assert ScheduledSequence(seq, 8, 1, feeds_last_sampled=True, is_sampling=True).token_ids == []


def test_step_request_is_the_same_message_built_in_place_or_apart():
    first, second = make_seq(1), make_seq(2, prompt_len=9)
    first.block_table, second.block_table = [3], [4, 5, 6]
    plan = StepPlan(9, [ScheduledSequence(first, 0, 5, is_sampling=True, sends_sampling=True),
                        ScheduledSequence(second, 4, 5, is_sampling=True)], [7, 8], [(1, 2)])
    wrapper = worker_pb2.StepStreamRequest()
    step_request(plan, wrapper.step)
    apart = step_request(plan)
    assert wrapper.step == apart
    assert [s.seq_id for s in apart.sequences] == [1, 2]
    assert list(apart.sequences[1].block_table) == [4, 5, 6]
    assert list(apart.sequences[1].token_ids) == list(range(14, 19))
    assert apart.sequences[0].HasField("sampling") and not apart.sequences[1].HasField("sampling")
    assert list(apart.release_seq_ids) == [7, 8]
    assert apart.pack_plain_tokens  # the scheduler reads bare tokens from the packed columns
    assert [(c.src_block, c.dst_block) for c in apart.block_copies] == [(1, 2)]


def test_sampled_tokens_read_every_field_and_leave_the_defaults_unset():
    reply = worker_pb2.StepResponse(tokens=[
        worker_pb2.SampledToken(seq_id=1, token_id=5),
        worker_pb2.SampledToken(seq_id=2, token_id=0, logprob=-0.5, num_accepted_draft_tokens=2,
                                top_logprobs=[worker_pb2.TokenAlternative(token_id=0, logprob=-0.5)],
                                draft_token_ids=[9, 10]),
    ])
    assert sampled_tokens(reply) == {
        1: SampledToken(1, 5),
        2: SampledToken(2, 0, -0.5, ((0, -0.5),), 2, (9, 10)),
    }
    assert sampled_tokens(reply)[1].logprob is None


def test_a_worker_asked_to_pack_answers_the_bare_tokens_in_columns():
    from services.worker.convert import step_to_proto
    from services.worker.sequence import SampledToken as WorkerToken, StepResult, TokenLogprob

    result = StepResult([
        WorkerToken(1, 5),
        WorkerToken(2, 6, logprob=-0.5, top_logprobs=[TokenLogprob(6, -0.5)]),
        WorkerToken(3, 7, num_accepted_draft_tokens=1),
        WorkerToken(4, 8, draft_token_ids=(9,)),
        WorkerToken(5, 0),
    ], execute_time_us=3)
    packed = step_to_proto(4, result, pack_plain=True)
    assert list(packed.plain_seq_ids) == [1, 5] and list(packed.plain_token_ids) == [5, 0]
    assert sampled_tokens(packed) == {
        1: 5, 5: 0,
        2: SampledToken(2, 6, -0.5, ((6, -0.5),)),
        3: SampledToken(3, 7, None, (), 1),
        4: SampledToken(4, 8, None, (), 0, (9,)),
    }
    plain = step_to_proto(4, result)  # a caller that did not ask gets entries for every token
    entries = {k: v for k, v in sampled_tokens(packed).items() if k in (2, 3, 4)}
    assert not plain.plain_seq_ids
    assert sampled_tokens(plain) == {1: SampledToken(1, 5), 5: SampledToken(5, 0), **entries}


def test_steady_decodes_lead_the_step_and_their_tokens_are_read_in_order_where_they_lead_the_reply():
    """The steady decodes go first among the decodes; a reply whose plain
    columns begin with them (request order) gives their tokens as they are,
    and any other reply (one refused or answered with more than its id) by id."""
    from services.scheduler.plan import SteadyDecodes
    from services.scheduler.worker_client import step_answer

    ahead, prefill, steady = make_seq(1), make_seq(2), [make_seq(3), make_seq(4)]
    plan = StepPlan(5, [ScheduledSequence(ahead, 5, 1, is_sampling=True, extends_table=-1),
                        ScheduledSequence(prefill, 0, 5, is_sampling=True, sends_sampling=True)],
                    steady=SteadyDecodes(steady, [3, 4], [-1, 9]))
    message = step_request(plan)
    assert list(message.decode_seq_ids) == [3, 4, 1] and list(message.decode_new_blocks) == [-1, 9, -1]
    assert [s.seq_id for s in message.sequences] == [2]
    in_order = worker_pb2.StepResponse(plain_seq_ids=[3, 4, 1, 2], plain_token_ids=[30, 40, 10, 20])
    answer = step_answer(in_order, [3, 4])
    assert answer.steady_tokens == [30, 40] and answer.tokens == {1: 10, 2: 20}
    assert step_answer(in_order, []).tokens == {3: 30, 4: 40, 1: 10, 2: 20}
    refused = worker_pb2.StepResponse(plain_seq_ids=[4, 1, 2], plain_token_ids=[40, 10, 20],
                                      refused=[worker_pb2.SequenceRefusal(seq_id=3, message="no")])
    answer = step_answer(refused, [3, 4])
    assert answer.steady_tokens is None and answer.tokens == {4: 40, 1: 10, 2: 20} and answer.refused == {3: "no"}
    other_refused = worker_pb2.StepResponse(plain_seq_ids=[3, 4, 2], plain_token_ids=[30, 40, 20],
                                            refused=[worker_pb2.SequenceRefusal(seq_id=1, message="no")])
    answer = step_answer(other_refused, [3, 4])
    assert answer.steady_tokens == [30, 40] and answer.tokens == {2: 20} and answer.refused == {1: "no"}
    entry = worker_pb2.StepResponse(plain_seq_ids=[4], plain_token_ids=[40],
                                    tokens=[worker_pb2.SampledToken(seq_id=3, token_id=30, logprob=-1.0)])
    answer = step_answer(entry, [3, 4])
    assert answer.steady_tokens is None and answer.tokens == {3: SampledToken(3, 30, -1.0), 4: 40}


def test_a_message_of_several_steps_asks_for_them_and_takes_only_their_tokens_step_after_step():
    from services.scheduler.plan import SteadyDecodes
    from services.scheduler.worker_client import step_answer

    plan = StepPlan(6, [], release_seq_ids=[7], steady=SteadyDecodes([make_seq(3), make_seq(4)], [3, 4], [-1, 9], 0, 3))
    message = step_request(plan)
    assert message.decode_steps == 3 and list(message.decode_seq_ids) == [3, 4]
    assert list(message.release_seq_ids) == [7] and not message.sequences
    assert step_request(StepPlan(7, [], steady=SteadyDecodes([make_seq(3)], [3], [-1]))).decode_steps == 0
    answer = step_answer(worker_pb2.StepResponse(plain_seq_ids=[3, 4] * 3, plain_token_ids=[30, 40, 31, 41, 32, 42]),
                         [3, 4], 3)
    assert answer.steady_tokens == [30, 40, 31, 41, 32, 42] and answer.tokens == {} and answer.refused == {}
    for wrong in (worker_pb2.StepResponse(plain_seq_ids=[3, 4] * 2, plain_token_ids=[30, 40, 31, 41]),  # a step short
                  worker_pb2.StepResponse(plain_seq_ids=[4, 3] * 3, plain_token_ids=[40, 30] * 3),  # out of order
                  worker_pb2.StepResponse(plain_seq_ids=[4] * 3, plain_token_ids=[40] * 3,
                                          refused=[worker_pb2.SequenceRefusal(seq_id=3, message="no")]),
                  worker_pb2.StepResponse(plain_seq_ids=[4] * 3, plain_token_ids=[40] * 3,
                                          tokens=[worker_pb2.SampledToken(seq_id=3, token_id=30, logprob=-1.0)] * 3)):
        with pytest.raises(ValueError, match="3 decode steps"):
            step_answer(wrong, [3, 4], 3)


def test_a_decode_goes_as_its_id_on_the_workers_table_until_the_table_is_a_new_list():
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker(token=7)
    seq = make_seq(1, prompt_len=3, max_tokens=20)
    seq.sampling = SamplingParams(top_logprobs=0)  # never a steady decode (those are below)
    policy.add(seq)
    prefill = policy.schedule()
    ahead = policy.schedule()  # planned before the prefill's answer: feeds the token in flight
    assert prefill.scheduled[0].extends_table is None  # sent whole
    assert ahead.scheduled[0].extends_table == -1  # position 3 is in the first block
    policy.postprocess(prefill, worker.step(prefill), 0, 0)
    grows = policy.schedule()
    assert grows.scheduled[0].extends_table == seq.block_table[1] and len(seq.block_table) == 2
    message = step_request(grows)
    assert list(message.decode_seq_ids) == [1] and list(message.decode_new_blocks) == [seq.block_table[1]]
    assert not message.sequences
    for plan in (ahead, grows):
        policy.postprocess(plan, worker.step(plan), 0, 0)
    seq.block_table = list(seq.block_table)  # as anything but growing leaves it (preemption, a shrink)
    assert policy.schedule().scheduled[0].extends_table is None  # sent whole again


def test_steady_decodes_go_as_columns_and_grow_their_tables_on_the_workers_copy():
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker()  # tokens from the context it reads back
    seqs = [make_seq(i, prompt_len=3, max_tokens=n) for i, n in ((1, 11), (2, 6))]
    for seq in seqs:
        policy.add(seq)
    plans = [policy.schedule(), policy.schedule()]
    assert not plans[1].scheduled and plans[1].steady.seq_ids == [1, 2] and plans[1].steady.new_blocks == [-1, -1]
    assert plans[1].num_decodes == plans[1].batch_size == 2
    tables = [{}, {s.seq_id: list(s.block_table) for s in seqs}]  # as each plan leaves them
    while plans[-1] is not None:
        policy.postprocess(plans[-2], worker.step(plans[-2]), 0, 0)
        plans.append(policy.schedule())
        tables.append({s.seq_id: list(s.block_table) for s in seqs})
    policy.postprocess(plans[-2], worker.step(plans[-2]), 0, 0)
    steady = [p.steady for p in plans[1:-1]]
    # 1 + 10 and 1 + 5 tokens, no step wasted; a last token is planned as any sequence's.
    assert [s.seq_ids for s in steady] == [[1, 2]] * 4 + [[1]] * 5 + [[]]
    assert [e.seq.seq_id for e in plans[5].scheduled] == [2] and [e.seq.seq_id for e in plans[10].scheduled] == [1]
    # A table gains its block in the step that feeds the block's first position (3 prompt tokens, blocks of 4).
    grown = [(n, i, b) for n, s in enumerate(steady, 1) for i, b in zip(s.seq_ids, s.new_blocks) if b >= 0]
    assert grown == [(2, 1, tables[2][1][1]), (2, 2, tables[2][2][1]), (6, 1, tables[6][1][2])]
    assert plans[10].scheduled[0].extends_table == tables[10][1][3]
    message = step_request(plans[2])
    assert list(message.decode_seq_ids) == [1, 2] and not message.sequences
    assert list(message.decode_new_blocks) == plans[2].steady.new_blocks
    assert [len(s.output_token_ids) for s in seqs] == [11, 6] and all(s.is_finished for s in seqs)
    assert policy.blocks.num_free_blocks == 100 and not policy._steady and not policy._steady_in_flight
    # The same tokens as planned one step at a time, each sent whole.
    again, fresh = make_policy(block_size=4), FakeWorker()
    copies = [make_seq(i, prompt_len=3, max_tokens=n) for i, n in ((1, 11), (2, 6))]
    for seq in copies:
        again.add(seq)
    while (plan := again.schedule()) is not None:
        assert not plan.steady.seqs
        again.postprocess(plan, fresh.step(plan), 0, 0)
    assert [s.output_token_ids for s in copies] == [s.output_token_ids for s in seqs]


def test_steady_decodes_are_sent_whole_again_after_the_engine_idled():
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker()
    seqs = [make_seq(i, prompt_len=3, max_tokens=14) for i in (1, 2)]
    for seq in seqs:
        policy.add(seq)
    outputs = []
    for _ in range(2):  # pipelined for a while, then every step answered before the next is planned
        plans = [policy.schedule(), policy.schedule()]
        for _ in range(4):
            policy.postprocess(plans[-2], worker.step(plans[-2]), 0, 0)
            plans.append(policy.schedule())
        assert plans[-1].steady.seq_ids == [1, 2]
        for plan in plans[-2:]:
            policy.postprocess(plan, worker.step(plan), 0, 0)
        whole = policy.schedule()  # nothing in flight: the worker checks every position it is sent
        assert not whole.steady.seqs and [e.extends_table for e in whole.scheduled] == [None, None]
        assert [e.num_computed_tokens for e in whole.scheduled] == [s.num_tokens - 1 for s in seqs]
        policy.postprocess(whole, worker.step(whole), 0, 0)
        outputs.append([len(s.output_token_ids) for s in seqs])
    assert outputs == [[7, 7], [14, 14]] and all(s.is_finished for s in seqs)
    again, fresh = make_policy(block_size=4), FakeWorker()
    copies = [make_seq(i, prompt_len=3, max_tokens=14) for i in (1, 2)]
    for seq in copies:
        again.add(seq)
    while (plan := again.schedule()) is not None:
        again.postprocess(plan, fresh.step(plan), 0, 0)
    assert [s.output_token_ids for s in copies] == [s.output_token_ids for s in seqs]


def test_a_worker_that_does_not_hold_tables_gets_every_decode_whole():
    import dataclasses

    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker(token=7)
    policy.capacity = dataclasses.replace(policy.capacity, holds_block_tables=False)  # an older worker
    policy.add(make_seq(1, prompt_len=3, max_tokens=20))
    plans = [policy.schedule(), policy.schedule()]
    for _ in range(4):
        policy.postprocess(plans[-2], worker.step(plans[-2]), 0, 0)
        plans.append(policy.schedule())
    assert all(e.feeds_last_sampled for p in plans[1:] for e in p.scheduled)
    assert all(e.extends_table is None for p in plans for e in p.scheduled)
    assert not step_request(plans[-1]).decode_seq_ids


def test_a_shrunk_table_is_a_new_list():
    from services.scheduler.block_manager import BlockManager

    blocks, seq = BlockManager(8, 4), make_seq(1, prompt_len=3)
    blocks.grow(seq, 12)
    table = seq.block_table
    blocks.shrink(seq, 5)  # the drafts' blocks go back
    assert seq.block_table is not table and seq.block_table == table[:2] and blocks.num_free_blocks == 6


def test_the_step_channel_is_dialled_at_the_host_of_the_workers_address():
    # As discovery writes them (services/common/kube.py) and as settings give them.
    assert host_of("10.0.3.7:50053") == "10.0.3.7"
    assert host_of("[fd00::12]:50053") == "fd00::12"
    assert host_of("worker-0.workers.ns.svc:50053") == "worker-0.workers.ns.svc"


def test_steady_decodes_stop_at_their_own_stop_ids_and_fill_the_prefix_cache_as_planned_one_at_a_time():
    """Three sequences of one prompt (one text): 1 stops at a token 3 never stops at
    (so the step's token is among the members' stop ids, not 3's), 2 at a later one.
    Against planning one step at a time (no steady decodes): the same tokens,
    the same blocks in the prefix cache, each token's latency and queue wait
    counted from the sequence's last one, and a member's full blocks hashed by
    the time a step is planned."""
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    def run(pipelined: bool, stops: dict[int, frozenset[int]]):
        policy, worker = make_policy(block_size=4), FakeWorker()
        seqs = [make_seq(i, prompt_len=3, max_tokens=30, stop_token_ids=stops.get(i, frozenset()), ignore_eos=True)
                for i in (1, 2, 3)]
        for seq in seqs:
            policy.add(seq)
        last = {s.seq_id: s.arrival_us for s in seqs}
        timings, stopped_steady, now = [], set(), 10_000
        plans = [policy.schedule()] + ([policy.schedule()] if pipelined else [])
        while plans[-1] is not None:
            plan = plans.pop(0)
            now += 1_000
            for seq, event in policy.postprocess(plan, worker.step(plan), now - 400, now):
                timings.append((event.latency_ms, event.queue_wait_us, (now - last[seq.seq_id]) / 1000,
                                max(0, now - 400 - last[seq.seq_id])))
                last[seq.seq_id] = now
                if seq.is_finished and seq in plan.steady.seqs:
                    stopped_steady.add(seq.seq_id)
                    # Its full blocks are in the prefix cache as it ends (blocks of 4 tokens).
                    text = Sequence(0, "again", seq.all_token_ids, SamplingParams(), seq.stopping, 0)
                    assert policy.num_cached_prefix_tokens(text) == (seq.num_tokens - 1) // 4 * 4
            plans.append(policy.schedule())
            for seq in policy._steady.values():
                assert len(seq.block_hashes) == seq.num_computed_tokens // 4
        for plan in plans[:-1]:
            now += 1_000
            policy.postprocess(plan, worker.step(plan), now - 400, now)
        assert all(s.is_finished for s in seqs)
        assert all(latency == expected and wait == expected_wait for latency, wait, expected, expected_wait in timings)
        return [s.output_token_ids for s in seqs], set(policy.blocks._cached), stopped_steady

    free_run, _, _ = run(False, {})
    assert free_run[0] == free_run[2] and len(set(free_run[0][4:])) > 2
    text = free_run[0]
    # The first new token past the sixth that fills a block as 1 ends (3 prompt tokens, the last one not computed).
    end_1 = next(n for n in range(6, 30) if text[n] not in text[:n] and (3 + n) % 4 == 0)
    end_2 = next(n for n in range(end_1 + 3, 30) if text[n] not in text[:n])
    stops = {1: frozenset({text[end_1]}), 2: frozenset({text[end_2]})}
    expected, cached, _ = run(False, stops)
    outputs, steady_cached, stopped_steady = run(True, stops)
    assert [len(o) for o in expected] == [end_1 + 1, end_2 + 1, 30] and outputs == expected
    assert steady_cached == cached and stopped_steady == {1, 2}


def test_steady_tokens_go_to_each_stream_at_once_and_alone_where_a_call_has_an_event_there():
    """Four members, three packed on two streams and one not: each stream gets
    its calls' tokens in member order with the step's statistics; where one
    of its calls has an event in the stream's message, that call's token is an
    event and the stream's other calls still get theirs."""
    from services.common.multiplex import PackedCall, PackedEntries
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker()
    seqs = [make_seq(i, prompt_len=2 + i, max_tokens=20) for i in (1, 2, 3, 4)]  # four texts
    for seq in seqs:
        policy.add(seq)
    wakes = []
    streams = [PackedEntries(lambda: wakes.append(1)), PackedEntries(lambda: wakes.append(2))]
    plans, delivered, now = [policy.schedule(), policy.schedule()], [], 10_000
    for step in range(8):
        plan = plans.pop(0)
        if step == 1:  # the first tokens are out: the server sets the sinks
            for seq, stream, call_id in zip(seqs, (streams[0], streams[1], streams[0]), (11, 22, 33)):
                seq.sink = PackedCall(stream, call_id)
        if step == 5:
            streams[0].evented.add(33)  # an event of call 33 is in stream 0's message
        if step == 6:
            streams[0].evented.clear()  # that message went out
        now += 1_000
        events = policy.postprocess(plan, worker.step(plan), now - 300, now)
        delivered.append({seq.seq_id: event.token_id for seq, event in events})
        if step >= 1:  # steady, with sinks
            assert plan.steady.seq_ids == [1, 2, 3, 4]
            tokens = {seq.seq_id: seq.output_token_ids[-1] for seq in seqs}
            assert delivered[-1] == ({3: tokens[3], 4: tokens[4]} if step == 5 else {4: tokens[4]})
            assert policy.packed_stats == {(4, 700, 1.0): 2 if step == 5 else 3}
        plans.append(policy.schedule())
    assert policy._lanes_for[0] == [seqs[0], seqs[1], seqs[2], seqs[3]]  # built once, then reused
    by_stream = [list(zip(s.call_ids, s.values)) for s in streams]
    outputs = {seq.seq_id: seq.output_token_ids for seq in seqs}
    # Tokens 2 to 8 of each (the first was delivered before; call 33's sixth went as an event).
    assert by_stream[0] == [p for n in range(1, 8) for p in ((11, outputs[1][n]), (33, outputs[3][n])) if
                            (p[0], n) != (33, 5)]
    assert by_stream[1] == [(22, outputs[2][n]) for n in range(1, 8)]
    # Every step's statistics are equal here: one run per stream.
    assert [(s.run_lengths, s.run_shared) for s in streams] == [([13], [(4, 700, 1.0)]), ([7], [(4, 700, 1.0)])]
    assert wakes[:2] == [1, 2] and len(wakes) == 2  # once each: the stream was empty


def test_steady_decodes_preempted_under_a_tiny_pool_come_back_with_the_same_text():
    """Four sequences in a pool too small for all (blocks of 4), planned one
    step ahead as the engine does, the worker running each step when it is
    sent: steady members are preempted (their blocks freed while a step of
    theirs is in flight), recomputed, and end with the text a large pool gives."""
    from collections import deque

    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    def run(num_blocks: int, in_order: bool = False):
        """`in_order`: the steady decodes' tokens are given in their order, as
        the worker client reads them where they lead the reply, not by id."""
        policy = make_policy(num_blocks=num_blocks)
        worker = FakeWorker(policy=policy)  # it fails a write into a block another sequence holds
        seqs = [make_seq(i, prompt_len=20 + i, max_tokens=40, ignore_eos=True) for i in range(1, 5)]
        for seq in seqs:
            policy.add(seq)
        sent: deque = deque()
        while True:
            if len(sent) < 2 and (plan := policy.schedule()) is not None:
                sampled = worker.step(plan)
                steady_tokens = [sampled.pop(i) for i in plan.steady.seq_ids] if in_order else None
                sent.append((plan, sampled, steady_tokens))
                if len(sent) < 2:
                    continue
            if not sent:
                break
            plan, sampled, steady_tokens = sent.popleft()
            policy.postprocess(plan, sampled, 0, 0, steady_tokens)
        assert all(s.is_finished for s in seqs) and policy.blocks.num_free_blocks == num_blocks
        return [s.output_token_ids for s in seqs], policy

    expected, roomy = run(400)
    outputs, tiny = run(24)
    assert roomy.num_preemptions == 0 and tiny.num_preemptions > 4
    assert tiny._steady_leaves > 0  # members left only by preemption: none ends as a steady decode here
    assert outputs == expected
    outputs, tiny = run(24, in_order=True)  # members preempted after planning: their tokens dropped by place
    assert tiny.num_preemptions > 4 and outputs == expected


def test_a_steady_member_the_worker_refused_is_dropped_from_the_step_planned_before_the_refusal():
    """The worker refuses a sequence in its first step; the step after, planned
    before that answer, has it as a steady decode, and the worker refuses it
    there again (it knows no such sequence) and answers no token for it: its
    request has ended, and its batch-mate goes on."""
    from services.scheduler.sequence import FinishReason
    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy, worker = make_policy(block_size=4), FakeWorker()
    seqs = [make_seq(i, prompt_len=3, max_tokens=8) for i in (1, 2)]
    for seq in seqs:
        policy.add(seq)
    first, second = policy.schedule(), policy.schedule()
    assert second.steady.seq_ids == [1, 2]
    answers = [worker.step(first), worker.step(second)]
    for answer in answers:
        del answer[2]  # refused: no token
    policy.finish(seqs[1], FinishReason.ABORT)  # as the engine ends a refused sequence's request
    policy.postprocess(first, answers[0], 0, 0)
    third = policy.schedule()
    policy.postprocess(second, answers[1], 0, 0)
    assert third.steady.seq_ids == [1] and seqs[0].output_token_ids == [answers[0][1], answers[1][1]]
    pending = [third]
    while pending:
        plan = pending.pop(0)
        answer = worker.step(plan)
        pending += [p for p in [policy.schedule()] if p is not None]
        policy.postprocess(plan, answer, 0, 0)
    assert seqs[0].is_finished and len(seqs[0].output_token_ids) == 8 and seqs[1].output_token_ids == []


def test_every_token_counts_its_latency_from_its_sequences_last_token_whether_steady_or_not():
    """Pipelined as the engine runs, each step answered at its own time, with
    sequences of several lengths in a small pool: members join, leave for their
    last token (planned as any), are preempted and come back. Every delivered
    token's queue wait and latency are from its own sequence's token before
    (or its arrival), and each ends with its last token's time, as accounting
    them one by one gives."""
    from collections import deque

    from tests.unit.scheduler.test_policy import FakeWorker, make_policy

    policy = make_policy(num_blocks=20)
    worker = FakeWorker(policy=policy)
    seqs = [make_seq(i, prompt_len=3 + i, max_tokens=6 + 5 * i, ignore_eos=True, arrival_us=0) for i in range(1, 7)]
    for seq in seqs:
        policy.add(seq)
    sent: deque = deque()
    times = {}  # step id -> (started, finished)
    last = {seq.seq_id: 0 for seq in seqs}  # when each one's last token was answered
    steady_tokens = preempted = 0
    for step in range(1, 1000):
        if len(sent) < 2 and (plan := policy.schedule()) is not None:
            sent.append((plan, worker.step(plan)))
            if len(sent) < 2:
                continue
        if not sent:
            break
        plan, sampled = sent.popleft()
        started, finished = step * 10_000 + 3 * plan.step_id, step * 10_000 + 7_000
        steady_tokens += len(plan.steady.seqs)
        before = policy.num_preemptions
        for seq, event in policy.postprocess(plan, sampled, started, finished):
            previous = last[seq.seq_id]
            assert (event.queue_wait_us, event.latency_ms) == (started - previous, (finished - previous) / 1000)
            last[seq.seq_id] = finished
        preempted += policy.num_preemptions - before
    assert all(s.is_finished for s in seqs) and steady_tokens > 50 and policy.num_preemptions > 0
    assert {seq.seq_id: seq.last_event_us for seq in seqs} == last
