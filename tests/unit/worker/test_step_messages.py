"""Greedy decoding end to end in one process, pipelined as the engine runs it:
the scheduler's policy plans each step before the last one's answer, the real
model (float32) runs the Step messages in order, and most decodes go as ids on
the block tables the worker holds (decode_seq_ids), growing them a block at a
time; without drafts, as steady decodes (the policy's columns). The text is
transformers' greedy text, with and without drafts."""
from __future__ import annotations

import itertools
from collections import deque

import grpc
import pytest
import torch

from services.common.errors import ServiceError
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequences
from services.scheduler.plan import WorkerCapacity
from services.scheduler.policy import BatchPolicy
from services.scheduler.speculation import SpeculationConfig, Speculator
from services.scheduler.worker_client import sampled_tokens, step_answer, step_request
from services.worker.convert import describe_to_proto, step_from_proto, step_to_proto
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from stormserve.scheduler.v1 import scheduler_pb2

MAX_TOKENS = 40
PROMPTS = ([1, 504, 3458, 282, 4649, 314], [1, 9690, 314, 260, 253, 1745, 30, 2, 1, 216, 42, 28, 7203],
           [1, 22, 23, 24, 25, 22, 23, 24, 25, 22, 23])  # the last repeats itself: drafts get accepted


@pytest.fixture(scope="module")
def small_blocks_runner(model_dir) -> ModelRunner:
    return ModelRunner(model_dir, select_platform("cpu"), dtype="float32", block_size=4,
                       kv_cache_bytes=16 * 2**20, max_batch_size=16)


@pytest.mark.parametrize("speculation, decode_steps", [("off", 1), ("ngram", 1), ("off", 4), ("off", 3)])
def test_pipelined_decodes_on_the_workers_tables_give_greedy_text(small_blocks_runner, reference_model, speculation,
                                                                  decode_steps):
    """With decode_steps, the steady decodes run that many steps a message
    (one block of 4 tokens, or 3: messages that end inside a block)."""
    runner = small_blocks_runner
    description = describe_to_proto(runner.describe())
    # No EOS: every sequence runs to max_tokens. It holds tables, as its Describe says.
    capacity = WorkerCapacity(description.num_kv_blocks, description.block_size, description.max_batch_size,
                              frozenset(), holds_block_tables=description.holds_block_tables,
                              max_decode_steps=description.max_decode_steps)
    policy = BatchPolicy(capacity, max_batch_size=16, max_prefill_tokens=512,
                         speculator=Speculator(SpeculationConfig(method=speculation)), decode_steps=decode_steps)
    ids = itertools.count(1)
    config = SchedulerConfig(max_batch_size=16)
    seqs = []
    for n, prompt in enumerate(PROMPTS):
        request = scheduler_pb2.GenerateRequest(request_id=f"r{n}", prompt_token_ids=prompt,
                                                sampling=scheduler_pb2.SamplingParams(temperature=0.0),
                                                stopping=scheduler_pb2.StoppingCriteria(max_tokens=MAX_TOKENS))
        group, _ = to_sequences(request, lambda: next(ids), config, 0)
        policy.add_group(group)
        seqs += group
    sent: deque = deque()  # (plan, answer), the worker having run the steps in the order sent
    decodes = new_blocks = steady = in_order = multi_step = 0
    while True:
        if len(sent) < 2 and (plan := policy.schedule()) is not None:
            message = step_request(plan)
            decodes += len(message.decode_seq_ids)
            new_blocks += sum(b >= 0 for b in message.decode_new_blocks)
            steady += len(plan.steady.seqs) * plan.steady.steps
            assert message.decode_steps == (plan.steady.steps if plan.steady.steps > 1 else 0)
            if plan.steady.steps > 1:  # steady decodes alone, a block at most
                assert not plan.scheduled and plan.steady.steps == decode_steps
                multi_step += 1
            reply = step_to_proto(message.step_id, runner.step(*step_from_proto(message), message.decode_steps or 1),
                                  pack_plain=True)
            assert not reply.refused
            answer = step_answer(reply, plan.steady.seq_ids, plan.steady.steps)
            if plan.steady.steps > 1:
                assert len(answer.steady_tokens) == plan.steady.steps * len(plan.steady.seqs)
            elif plan.steady.seqs:  # the worker answered the steady decodes first, in order
                by_id = sampled_tokens(reply)
                assert answer.steady_tokens == [by_id[i] for i in plan.steady.seq_ids]
                assert not answer.tokens.keys() & set(plan.steady.seq_ids)
                in_order += 1
            sent.append((plan, answer))
            if len(sent) < 2:
                continue
        if not sent:
            break
        plan, answer = sent.popleft()
        policy.postprocess(plan, answer.tokens, 0, 0, answer.steady_tokens)
    assert decodes > 10 and new_blocks > 3  # most decodes went as ids, tables grew by them
    if decode_steps == 1:
        assert in_order > 5 if speculation == "off" else in_order == 0
    assert steady > 50 if speculation == "off" else steady == 0
    assert multi_step > 5 if decode_steps > 1 else multi_step == 0
    assert policy.num_free_blocks == capacity.num_kv_blocks
    for seq, prompt in zip(seqs, PROMPTS):
        want = reference_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                        min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_token_ids == want


def test_a_worker_offers_decode_steps_and_refuses_more(small_blocks_runner):
    runner = small_blocks_runner
    offered = describe_to_proto(runner.describe()).max_decode_steps
    assert offered == 64
    with pytest.raises(ServiceError, match="decode_steps 65") as refused:
        runner.step([], decode_steps=offered + 1)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
