"""Decode steps replayed from graphs (graphs.py), held to the eager runner on the
bundled model in float32. graphs.EagerCapture stands in for the device's
capture: a replay runs the captured forward again over the persistent
buffers, so what is tested is what a graph depends on (the buffers' contents,
the padding, the null block, the choice between replay and eager); the CPU's
native attention kernel reads the buffers through its graph_inputs."""
from __future__ import annotations

import pytest
import torch

from services.worker.graphs import EagerCapture, EagerGraph, StepGraphs, capture_sizes
from services.worker.kv_cache import KVCacheSpec
from services.worker.model_loading import auto_kv_budget
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams, SequenceInput
from tests.unit.worker.block_tables import BlockTables
from tests.unit.worker.conftest import TEST_BLOCK_SIZE

GREEDY = SamplingParams(temperature=0.0)
MAX_SEQ_LEN = 48  # 12 blocks of 4 tokens: a longer sequence steps eagerly


class CountingCapture(EagerCapture):
    def __init__(self):
        self.replays = 0

    def new_graph(self) -> EagerGraph:
        capture = self

        class Counted(EagerGraph):
            def replay(self, seq_lens: list[int]) -> None:
                capture.replays += 1
                super().replay(seq_lens)

        return Counted()


@pytest.fixture(scope="module")
def capture() -> CountingCapture:
    return CountingCapture()


@pytest.fixture(scope="module")
def graph_runner(model_dir, capture) -> ModelRunner:
    return ModelRunner(model_dir, select_platform("cpu"), dtype="float32", block_size=TEST_BLOCK_SIZE,
                       kv_cache_bytes=32 * 2**20, max_batch_size=8, max_seq_len=MAX_SEQ_LEN, graph_capture=capture)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(100, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_capture_sizes_follow_vllms_choice():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def test_runner_captures_every_size_and_reserves_the_null_block(graph_runner):
    graphs = graph_runner.graphs
    assert graphs is not None and graphs.num_graphs == len(capture_sizes(8)) == 4
    assert graphs.null_block == graph_runner.kv_pool.num_blocks  # never a block the scheduler hands out
    assert graph_runner.kv_pool.key_cache.shape[1] == (graph_runner.kv_pool.num_blocks + 1) * TEST_BLOCK_SIZE
    assert graph_runner.describe().num_kv_blocks == graph_runner.kv_pool.num_blocks


def _decode(runner: ModelRunner, prompts: dict[int, list[int]], steps: int) -> tuple[dict, list[torch.Tensor]]:
    """Prefill every prompt in one step, then `steps` greedy decode steps of all
    of them: the tokens per sequence and each decode step's logits."""
    tables = BlockTables(runner)
    out = {seq_id: [] for seq_id in prompts}
    first = runner.step([tables.feed(seq_id, p, 0, True, GREEDY) for seq_id, p in prompts.items()])
    for t in first.tokens:
        out[t.seq_id].append(t.token_id)
    all_logits = []
    for _ in range(steps):
        inputs = [tables.feed(seq_id, [out[seq_id][-1]], len(p) + len(out[seq_id]) - 1, True)
                  for seq_id, p in prompts.items()]
        all_logits.append(runner.forward(inputs).clone())  # a replay rewrites them
        for seq_id, logits in zip(prompts, all_logits[-1]):
            out[seq_id].append(int(logits.argmax()))
    for seq_id in prompts:
        runner.release(seq_id)
    return out, all_logits


def test_replayed_decodes_equal_eager_ones(runner, graph_runner, capture):
    """Three sequences (padded to four) of different lengths decode across block
    boundaries: every step replays, with the eager runner's logits."""
    prompts = {1: _prompt(1, 5), 2: _prompt(2, 11), 3: _prompt(3, 2)}
    before = capture.replays
    tokens, logits = _decode(graph_runner, prompts, steps=6)
    assert capture.replays - before == 6
    want_tokens, want_logits = _decode(runner, prompts, steps=6)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


def test_padding_writes_only_the_null_block(graph_runner):
    pool = graph_runner.kv_pool
    tables = BlockTables(graph_runner)
    prompt = _prompt(4, 6)
    first = graph_runner.step([tables.feed(9, prompt, 0, True, GREEDY)])
    used = {b for t in tables._tables.values() for b in t}
    slots_per_block = TEST_BLOCK_SIZE
    untouched = torch.tensor([b for b in range(pool.num_blocks) if b not in used])
    rows = (untouched[:, None] * slots_per_block + torch.arange(slots_per_block)).flatten()
    with torch.inference_mode():
        pool.key_cache[:, rows] = 7.0
    # One sequence replays the size-1 graph; then three pad to four (one padding sequence).
    graph_runner.step([tables.feed(9, [first.tokens[0].token_id], len(prompt), True)])
    others = [tables.feed(seq_id, _prompt(seq_id, 3), 0, True, GREEDY) for seq_id in (10, 11)]
    graph_runner.step(others)
    used = {b for t in tables._tables.values() for b in t}
    untouched = torch.tensor([b for b in range(pool.num_blocks) if b not in used])
    rows = (untouched[:, None] * slots_per_block + torch.arange(slots_per_block)).flatten()
    graph_runner.step([tables.feed(s, [5], n, True) for s, n in ((9, len(prompt) + 1), (10, 3), (11, 3))])
    assert bool((pool.key_cache[:, rows] == 7.0).all())
    null_slots = graph_runner.graphs.null_block * slots_per_block + torch.arange(slots_per_block)
    assert not bool((pool.key_cache[:, null_slots] == 0).all())  # the padding wrote there
    for seq_id in (9, 10, 11):
        graph_runner.release(seq_id)


def test_drafted_rows_replay_a_graph_captured_on_first_sight(runner, graph_runner, capture):
    """Two sequences each feeding their last token and two drafted ones."""
    results = []
    for r in (runner, graph_runner):
        tables = BlockTables(r)
        prompts = {21: _prompt(21, 7), 22: _prompt(22, 4)}
        r.step([tables.feed(seq_id, p, 0, True, GREEDY) for seq_id, p in prompts.items()])
        before = capture.replays
        inputs = [SequenceInput(seq_id, [11, 12, 13], len(p), True, None, tables.table(seq_id, len(p) + 3),
                                num_draft_tokens=2) for seq_id, p in prompts.items()]
        results.append(r.forward(inputs))
        if r is graph_runner:
            assert capture.replays == before + 1
            assert (3, 2) in r.graphs._graphs
        for seq_id in prompts:
            r.release(seq_id)
    assert results[0].shape == (6, 49152)
    torch.testing.assert_close(results[1], results[0], atol=2e-4, rtol=1e-5)


def test_steps_no_graph_takes_run_eagerly(runner, graph_runner, capture):
    """A context past the buffers' block tables, and a mixed step, run eagerly."""
    for r in (runner, graph_runner):
        tables = BlockTables(r)
        long_prompt = _prompt(30, MAX_SEQ_LEN + 3)
        r.step([tables.feed(30, long_prompt, 0, True, GREEDY)])
        before = capture.replays
        logits = r.forward([tables.feed(30, [5], len(long_prompt), True)])
        mixed = r.forward([tables.feed(30, [6], len(long_prompt) + 1, True),
                           tables.feed(31, _prompt(31, 3), 0, True, GREEDY)])
        assert capture.replays == before
        r.release(30)
        r.release(31)
        if r is runner:
            want = logits, mixed
    torch.testing.assert_close(logits, want[0], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(mixed, want[1], atol=2e-4, rtol=1e-5)


def test_graphs_are_off_where_the_model_cannot_be_captured(model_dir):
    """Without a capture, or with attention through SDPA (float32 blocks the CPU
    kernel takes, but no kernel here), every step is eager."""
    off = ModelRunner(model_dir, select_platform("cpu"), dtype="float32", block_size=TEST_BLOCK_SIZE,
                      kv_cache_bytes=4 * 2**20, max_batch_size=2, max_seq_len=MAX_SEQ_LEN)
    assert off.graphs is None and off.kv_pool.key_cache.shape[1] == off.kv_pool.num_blocks * TEST_BLOCK_SIZE


def test_graph_memory_is_taken_from_the_automatic_kv_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)

    class Device:
        kv_memory_fraction = 0.5

        @staticmethod
        def available_memory() -> int:
            return 2**20

    assert auto_kv_budget(spec, 10**6, 10**6, Device, reserved=0) == 2**19
    assert auto_kv_budget(spec, 10**6, 10**6, Device, reserved=2**18) == 2**18
    assert auto_kv_budget(spec, 10**6, 10**6, Device, reserved=2**20) == 0


def test_measure_counts_the_largest_graph_and_drops_it(graph_runner):
    class Growing(EagerCapture):
        in_use, emptied = 0, 0

        def new_graph(self) -> EagerGraph:
            self.in_use += 1000
            return EagerGraph()

        def memory_in_use(self) -> int:
            return self.in_use

        def empty_cache(self) -> None:
            self.emptied += 1

    capture = Growing()
    probe = StepGraphs(capture, graph_runner.decoder, graph_runner.kv_pool, graph_runner.attention_kernel, 8, 4,
                       torch.device("cpu"))
    with torch.inference_mode():
        taken = probe.measure()
    assert taken == 1000 and probe.num_graphs == 0 and capture.emptied == 1


def test_a_failed_capture_leaves_the_worker_serving_eagerly(model_dir, runner):
    class Failing(EagerCapture):
        def new_graph(self) -> EagerGraph:
            class Broken(EagerGraph):
                def capture(self, run):
                    raise RuntimeError("operation not permitted when stream is capturing")

            return Broken()

    for kv_cache_bytes in (0, 4 * 2**20):  # with the measure before an automatic budget, and without
        r = ModelRunner(model_dir, select_platform("cpu"), dtype="float32", block_size=TEST_BLOCK_SIZE,
                        kv_cache_bytes=kv_cache_bytes, max_batch_size=2, max_seq_len=MAX_SEQ_LEN,
                        graph_capture=Failing())
        assert r.graphs is None
        prompts = {1: _prompt(1, 5)}
        assert _decode(r, prompts, 2)[0] == _decode(runner, prompts, 2)[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_mixture_of_experts_decodes_replay_with_transformers_tokens(family, tmp_path):
    """The experts' routing sorts and counts rows on the device without a host
    read, so MoE layers are captured too: greedy tokens equal generate()'s."""
    from tests.moe_models import reference_model

    reference = reference_model(family, 256)
    reference.save_pretrained(tmp_path)
    capture = CountingCapture()
    r = ModelRunner(tmp_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                    max_batch_size=4, max_seq_len=MAX_SEQ_LEN, graph_capture=capture)
    assert r.graphs is not None
    prompts = {1: _prompt(1, 9), 2: _prompt(2, 5)}
    prompts = {s: [t % 256 for t in p] for s, p in prompts.items()}
    tokens, _ = _decode(r, prompts, steps=8)
    assert capture.replays == 8
    for seq_id, prompt in prompts.items():
        with torch.inference_mode():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False,
                                      min_new_tokens=9)[0, len(prompt):].tolist()
        assert tokens[seq_id] == want
