"""Whole tiny models of the MoE families through the lean path: DeepSeek-V3
(MLA over the latent pool, group-limited MoE with a random selection bias,
dense first layers, shared experts), Qwen3-MoE and Qwen2-MoE. Logits equal
transformers' own eager float32 forward at every step of a schedule that packs
two sequences, prefills in chunks over cached blocks and decodes; greedy
tokens equal its generate()."""
from __future__ import annotations


import pytest
import torch

from services.worker.decoder import LeanDecoder
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams, SequenceInput
from tests.moe_models import FAMILIES, reference_model
from tests.unit.worker.block_tables import BlockTables, assert_schedule_matches

VOCAB = 256


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    reference = reference_model(request.param, VOCAB)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=8)
    assert isinstance(runner.decoder, LeanDecoder)
    return request.param, reference, runner


def test_every_step_matches_transformers(family):
    _, reference, runner = family
    generator = torch.Generator().manual_seed(1)
    tokens = {1: torch.randint(0, VOCAB, (23,), generator=generator).tolist(),
              2: torch.randint(0, VOCAB, (15,), generator=generator).tolist()}
    with torch.inference_mode():
        expected = {s: reference(torch.tensor([t])).logits[0] for s, t in tokens.items()}
    assert_schedule_matches(runner, expected, tokens)
    for seq_id in tokens:
        runner.release(seq_id)


def test_greedy_tokens_equal_generate(family):
    name, reference, runner = family
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      min_new_tokens=12)[0, len(prompt):].tolist()
    tables = BlockTables(runner)
    greedy = SamplingParams(temperature=0.0)
    produced = []
    step = [tables.feed(7, prompt, 0, True, greedy)]
    while len(produced) < len(expected):
        token = runner.step(step).tokens[0].token_id
        produced.append(token)
        step = [tables.feed(7, [token], len(prompt) + len(produced) - 1, True, None)]
    runner.release(7)
    assert produced == expected, name


def _greedy(runner, seq_id, tokens, num_computed, table, num_new, num_prompt_tokens=0):
    """`num_new` greedy tokens of a sequence whose first step feeds tokens[num_computed:]
    over `table` (which must hold every position); the worker's sequence is released after."""
    greedy = SamplingParams(temperature=0.0)
    produced = []
    step = SequenceInput(seq_id, tokens[num_computed:], num_computed, True, greedy, table, num_prompt_tokens)
    position = len(tokens)
    while len(produced) < num_new:
        token = runner.step([step]).tokens[0].token_id
        produced.append(token)
        step = SequenceInput(seq_id, [token], position, True, None, table)
        position += 1
    runner.release(seq_id)
    return produced


def test_the_latent_cache_serves_a_prefix_hit_and_a_preempted_sequence(family, tmp_path):
    """A second prompt starts from the first one's cached blocks (its first step
    computes only its own tokens); a sequence preempted after 3 tokens is
    recomputed from its prompt and outputs into other blocks and goes on. Both
    give transformers' greedy tokens."""
    name, reference, runner = family
    generator = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (8,), generator=generator).tolist()
    first = shared + torch.randint(0, VOCAB, (5,), generator=generator).tolist()
    second = shared + torch.randint(0, VOCAB, (3,), generator=generator).tolist()

    def expected(prompt, n):
        with torch.inference_mode():
            return reference.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)[0, len(prompt):].tolist()

    size = runner.block_size
    blocks = iter(range(runner.kv_pool.num_blocks))
    table_a = [next(blocks) for _ in range(-(-(len(first) + 6) // size))]
    assert _greedy(runner, 1, first, 0, table_a, 6) == expected(first, 6)
    # The first 8 tokens' two blocks are shared; the rest of the table is the second prompt's own.
    table_b = table_a[:8 // size] + [next(blocks) for _ in range(-(-(len(second) + 6 - 8) // size))]
    assert _greedy(runner, 2, second, 8, table_b, 6) == expected(second, 6), name
    # Preemption: 3 tokens, the sequence forgotten, then recomputed whole elsewhere.
    table_c = [next(blocks) for _ in range(-(-(len(first) + 9) // size))]
    head = _greedy(runner, 3, first, 0, table_c, 3)
    table_d = [next(blocks) for _ in range(-(-(len(first) + 9) // size))]
    tail = _greedy(runner, 4, first + head, 0, table_d, 6, num_prompt_tokens=len(first))
    assert head + tail == expected(first, 9), name
