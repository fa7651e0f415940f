"""Beam search end to end in one process: the scheduler's policy drives the real
model (float32) through the same Step messages the chain sends, block copies
included, and gives what HF transformers' own beam search gives."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoTokenizer

from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequences
from services.scheduler.plan import WorkerCapacity
from services.scheduler.policy import BatchPolicy
from services.scheduler.worker_client import sampled_tokens, step_request
from services.worker.platforms import select_platform
from services.worker.convert import step_from_proto, step_to_proto
from services.worker.model_runner import ModelRunner
from stormserve.scheduler.v1 import scheduler_pb2


@pytest.fixture(scope="module")
def beam_runner(model_dir) -> ModelRunner:
    # Its own pool: the policy hands out every block of it.
    return ModelRunner(model_dir, select_platform("cpu"), dtype="float32", block_size=4,
                       kv_cache_bytes=16 * 2**20, max_batch_size=16)


def run_search(runner: ModelRunner, prompt: list[int], width: int, n: int, max_tokens: int):
    description = runner.describe()
    capacity = WorkerCapacity(description.num_kv_blocks, description.block_size, description.max_batch_size,
                              frozenset(description.eos_token_ids))
    policy = BatchPolicy(capacity, max_batch_size=16, max_prefill_tokens=512)
    request = scheduler_pb2.GenerateRequest(
        request_id="beam", prompt_token_ids=prompt, use_beam_search=True, n=n, best_of=width,
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=max_tokens))
    ids = itertools.count(1)
    results, _ = to_sequences(request, lambda: next(ids), SchedulerConfig(max_batch_size=16), 0)
    policy.add_group(results)
    num_copies = 0
    while (plan := policy.schedule()) is not None:
        num_copies += len(plan.block_copies)
        message = step_request(plan)
        reply = step_to_proto(message.step_id, runner.step(*step_from_proto(message)))
        policy.postprocess(plan, sampled_tokens(reply), 0, 0)
    assert policy.num_free_blocks == capacity.num_kv_blocks
    return results, num_copies


@pytest.mark.parametrize("question, width, n, max_tokens", [
    ("What is 2+2?", 3, 3, 16),  # short answers: hypotheses end with EOS
    ("Write a poem about the sea.", 4, 2, 10),  # every beam runs to max_tokens
])
def test_beam_search_gives_what_transformers_gives(beam_runner, model_dir, reference_model, question, width, n,
                                                   max_tokens):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    results, num_copies = run_search(beam_runner, list(prompt), width, n, max_tokens)
    assert num_copies > 0  # forks copied a partial block
    out = reference_model.generate(
        torch.tensor([prompt]), num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_tokens,
        early_stopping=False, length_penalty=1.0, output_scores=True, return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id)
    eos = set(beam_runner.describe().eos_token_ids)
    for result, sequence, score in zip(results, out.sequences, out.sequences_scores):
        want = sequence[len(prompt):].tolist()
        if eos & set(want):  # HF pads finished hypotheses after their EOS
            want = want[: min(want.index(e) for e in eos & set(want)) + 1]
        assert result.output_token_ids == want, tokenizer.decode(result.output_token_ids)
        assert result.ended_by_stop_token == (want[-1] in eos)
        assert result.cumulative_logprob / len(want) == pytest.approx(score.item(), abs=1e-3)
