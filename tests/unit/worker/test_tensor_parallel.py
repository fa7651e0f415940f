"""Tensor parallelism on CPU: rank 0 in this process, rank 1 a real follower
process (python -m services.worker.follower) over gloo. The bundled model's 3
KV-head groups split 2 and 1, its MLP and vocabulary in halves; the group's
log-probs (logits, normalised) must be the single process's within float32
rounding, for a packed prefill, chunked prefill and decodes."""
from __future__ import annotations

import pytest

from services.common.config import load_config
from services.worker.config import WorkerConfig
from services.worker.follower import build_runner
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel, balanced_range
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams
from tests.unit.worker.block_tables import BlockTables

TOP = 50  # log-probs compared per sampled token


def test_balanced_ranges_cover_everything_once():
    for total, parts in [(3, 2), (9, 4), (1536, 2), (7, 7)]:
        ranges = [balanced_range(total, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


@pytest.fixture(scope="module")
def group_runner():
    config = load_config(WorkerConfig, environ={}, argv=[
        "--device", "cpu", "--dtype", "float32", "--cache-block-size", "4", "--kv-cache-mib", "16",
        "--max-batch-size", "8", "--tensor-parallel-size", "2", "--num-threads", "1"])
    platform = select_platform("cpu")
    group = TensorParallel.start(config, platform)
    try:
        yield build_runner(config, platform, group)
    finally:
        group.close()


def _generate(runner: ModelRunner, prompts: list[list[int]], num_decodes: int) -> list[list]:
    """Prompts 0 and 1 prefilled together, prompt 2 in two chunks, then decodes of all."""
    tables = BlockTables(runner)
    params = SamplingParams(temperature=0.0, top_logprobs=TOP)
    out = []
    first = runner.step([tables.feed(0, prompts[0], 0, True, params), tables.feed(1, prompts[1], 0, True, params),
                         tables.feed(2, prompts[2][:9], 0, False, params)]).tokens
    second = runner.step([tables.feed(2, prompts[2][9:], 9, True)]).tokens
    tokens = {t.seq_id: t for t in first + second}
    lengths = {i: len(p) for i, p in enumerate(prompts)}
    for _ in range(num_decodes):
        out.append([tokens[i] for i in range(3)])
        step = runner.step([tables.feed(i, [tokens[i].token_id], lengths[i], True) for i in range(3)]).tokens
        lengths = {i: n + 1 for i, n in lengths.items()}
        tokens = {t.seq_id: t for t in step}
    out.append([tokens[i] for i in range(3)])
    runner.step([], release_seq_ids=[0, 1, 2])
    return out


def test_two_ranks_give_one_ranks_logprobs(group_runner, runner):
    assert group_runner.kv_pool.spec.num_kv_heads == 2  # rank 0's two of three KV-head groups
    prompts = [list(range(700, 731)), list(range(900, 905)), list(range(1200, 1223))]
    together, alone = _generate(group_runner, prompts, 6), _generate(runner, prompts, 6)
    for step_together, step_alone in zip(together, alone):
        for a, b in zip(step_together, step_alone):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top_logprobs[:5]] == [t.token_id for t in b.top_logprobs[:5]]
            for x, y in zip(a.top_logprobs, b.top_logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
