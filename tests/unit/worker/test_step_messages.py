"""Greedy decoding end to end in one process, pipelined as the engine runs it:
the scheduler's policy plans each step before the last one's answer, the real
model (float32) runs the Step messages in order, and most decodes go as ids on
the block tables the worker holds (decode_seq_ids), growing them a block at a
time; without drafts, as steady decodes (the policy's columns). The text is
transformers' greedy text, with and without drafts."""
from __future__ import annotations

import itertools
from collections import deque

import pytest
import torch

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


@pytest.mark.parametrize("speculation", ["off", "ngram"])
def test_pipelined_decodes_on_the_workers_tables_give_greedy_text(small_blocks_runner, reference_model, speculation):
    runner = small_blocks_runner
    description = runner.describe()
    # No EOS: every sequence runs to max_tokens. It holds tables, as its Describe says.
    capacity = WorkerCapacity(description.num_kv_blocks, description.block_size, description.max_batch_size,
                              frozenset(), holds_block_tables=describe_to_proto(description).holds_block_tables)
    policy = BatchPolicy(capacity, max_batch_size=16, max_prefill_tokens=512,
                         speculator=Speculator(SpeculationConfig(method=speculation)))
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
    decodes = new_blocks = steady = in_order = 0
    while True:
        if len(sent) < 2 and (plan := policy.schedule()) is not None:
            message = step_request(plan)
            decodes += len(message.decode_seq_ids)
            new_blocks += sum(b >= 0 for b in message.decode_new_blocks)
            steady += len(plan.steady.seqs)
            reply = step_to_proto(message.step_id, runner.step(*step_from_proto(message)), pack_plain=True)
            assert not reply.refused
            answer = step_answer(reply, plan.steady.seq_ids)
            if plan.steady.seqs:  # the worker answered the steady decodes first, in order
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
    assert in_order > 5 if speculation == "off" else in_order == 0
    assert steady > 50 if speculation == "off" else steady == 0
    assert policy.num_free_blocks == capacity.num_kv_blocks
    for seq, prompt in zip(seqs, PROMPTS):
        want = reference_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                        min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_token_ids == want
