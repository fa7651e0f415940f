"""Decode steps replayed from CUDA graphs, and the sampler on the device, on a
real GPU (skipped without CUDA; bench/gpu_check.sh runs them):

- float32 with graphs gives the CPU float32 runner's greedy tokens, and the
  decode steps did replay (every size captured at start);
- bfloat16 with graphs gives the logits of bfloat16 without them on a drafted
  step (captured on first sight), up to the rounding of matmuls over a padded
  batch: far below the bfloat16 tolerance against float32;
- the sampler on the device (the sorted-vocabulary draws, one pinned copy
  back) gives the CPU sampler's greedy tokens and top-k draws.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.worker import sampler
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams
from tests.gpu.models import check_model
from tests.gpu.test_cuda import KV_CACHE_BYTES, NUM_TOKENS, PROMPTS, greedy, leading_agreement, report
from tests.unit.worker.block_tables import BlockTables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model():
    return check_model()


def runner(model, dtype: str, graphs: bool) -> ModelRunner:
    platform = select_platform("cuda")
    return ModelRunner(model[0], platform, dtype, 16, KV_CACHE_BYTES, 8,
                       graph_capture=platform.graph_capture() if graphs else None)


class Replays:
    """Counts the replays of a runner's graphs."""

    def __init__(self, r: ModelRunner):
        self.count = 0
        for graph, _ in r.graphs._graphs.values():
            replay = graph.replay

            def counted(seq_lens, replay=replay):
                self.count += 1
                replay(seq_lens)

            graph.replay = counted


def test_float32_graphs_give_the_cpu_float32_tokens(request, model):
    cpu = ModelRunner(model[0], select_platform("cpu"), "float32", 16, KV_CACHE_BYTES, 8)
    want = greedy(cpu, PROMPTS, NUM_TOKENS)
    r = runner(model, "float32", graphs=True)
    assert r.graphs is not None and r.graphs.num_graphs == 4  # 1, 2, 4, 8
    replays = Replays(r)
    got = greedy(r, PROMPTS, NUM_TOKENS)
    report(request, model=model[1], replays=replays.count, tokens_equal=got == want)
    assert replays.count == NUM_TOKENS - 1  # every step but the prefill
    assert got == want


def drafted_logits(r: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """Each prompt prefilled, then one step of every sequence feeding its first
    continuation token and three drafted ones: [prompts * 4, vocab]."""
    tables = BlockTables(r)
    r.step([tables.feed(200 + i, p, 0, True, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)])
    inputs = [dataclasses.replace(tables.feed(200 + i, c[:4], len(p), True), num_draft_tokens=3)
              for i, (p, c) in enumerate(zip(prompts, continuations))]
    logits = r.forward(inputs).float().cpu()
    for i in range(len(prompts)):
        r.release(200 + i)
    return logits


def test_bfloat16_graphs_give_the_eager_logits(request, model):
    eager, graphed = runner(model, "bfloat16", graphs=False), runner(model, "bfloat16", graphs=True)
    tokens = greedy(eager, PROMPTS, NUM_TOKENS)
    # Padded to four sequences, the matmuls may round otherwise: tokens can part at a near tie, logits stay close.
    agreed = [leading_agreement(g, t) for g, t in zip(greedy(graphed, PROMPTS, NUM_TOKENS), tokens)]
    # Two sequences of four rows (8, the batch limit): the drafted shape is captured on first sight.
    want = drafted_logits(eager, PROMPTS[:2], tokens)
    got = drafted_logits(graphed, PROMPTS[:2], tokens)
    assert (4, 2) in graphed.graphs._graphs
    error = (got - want).abs().max().item()
    report(request, max_logit_error=error, tokens_agreed=agreed, of=NUM_TOKENS)
    assert error <= 0.05


def test_the_device_sampler_draws_as_the_cpu_one(model):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=generator) * 3
    params = [SamplingParams(temperature=0.0, top_logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=1.0, top_k=5, seed=2),
              SamplingParams(temperature=0.7, top_k=40, top_logprobs=2, seed=3), SamplingParams(temperature=0.0)]

    def draw(device: str):
        generators = [None if p.is_greedy else torch.Generator().manual_seed(p.seed) for p in params]
        return sampler.sample(logits.to(device), params, generators)

    cpu, cuda = draw("cpu"), draw("cuda")
    assert cuda.token_ids == cpu.token_ids
    for a, b in zip(cuda.logprobs, cpu.logprobs):
        assert (a is None) == (b is None) and (a is None or abs(a - b) < 1e-3)
    assert [[t.token_id for t in row] for row in cuda.top_logprobs] == \
        [[t.token_id for t in row] for row in cpu.top_logprobs]
