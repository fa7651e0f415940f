"""Ascend graphs on CPU: the fake torch_npu's NPUGraph (tests/fake_npu/torch_npu/_graphs.py)
held to the real capture/replay/update semantics, and the NPU attention kernel
replayed from a captured decode step over persistent buffers (graphs.py) held
to the same kernel run eagerly on the same step."""
from __future__ import annotations

import gc

import pytest
import torch

from services.worker import attention
from services.worker.graphs import GraphBuffers
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.platforms.cpu import CpuPlatform

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 128
SCALE = HEAD_DIM ** -0.5


def _attend(npu, query, cache, block_table, ends, kv_lens):
    """The fused op over one paged cache for key and value (what these tests need of it)."""
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)
    out, _ = npu.npu_fused_infer_attention_score(
        query, cache, cache, atten_mask=mask, block_table=block_table, input_layout="TND", block_size=BLOCK,
        actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens, num_heads=HEADS, num_key_value_heads=KV_HEADS,
        scale=SCALE, sparse_mode=3)
    return out


# --- the fake's graph semantics --------------------------------------------------------------------------------


def test_replay_rereads_tensors_and_keeps_host_values_of_the_capture(npu_platform):
    x = torch.arange(4.0)
    offset, shape = 1, [2, 2]
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y = (x * 2 + offset).view(shape)  # offset and shape are host values: baked
    offset, shape[0] = 100, 4  # noqa: F841 (what a replay must not see)
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([[21.0, 41.0], [61.0, 81.0]]))


def test_a_capture_may_not_read_a_device_value_on_the_host(npu_platform):
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="reads a device value on the host"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            int(x.sum())


def test_a_graph_holds_what_its_capture_allocated(npu_platform):
    before = torch.npu.memory_allocated()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, pool=torch.npu.graph_pool_handle()):
        y = torch.zeros(1024) + 1  # two float32 [1024] allocations
    assert torch.npu.memory_allocated() - before >= 2 * 4096
    del y, g
    gc.collect()
    assert torch.npu.memory_allocated() == before


def _paged_cache(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(4, BLOCK, KV_HEADS * HEAD_DIM)


def test_update_refreshes_the_attention_ops_context_lengths_in_capture_order(npu_platform):
    npu = npu_platform._npu
    cache, query = _paged_cache(0), torch.randn(2, HEADS, HEAD_DIM)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        first = _attend(npu, query, cache, table, [1, 2], [5, 9])
        second = _attend(npu, query[:1], cache, table[:1], [1], [3])

    g.replay()  # no update: the lengths of the capture
    assert torch.equal(first, _attend(npu, query, cache, table, [1, 2], [5, 9]))

    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [200, 130]}, {"actual_seq_lengths_kv": [70]}])
    g.replay()
    assert torch.equal(first, _attend(npu, query, cache, table, [1, 2], [200, 130]))
    assert torch.equal(second, _attend(npu, query[:1], cache, table[:1], [1], [70]))

    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [60, 61]}, {"actual_seq_lengths_kv": [62]}])
    cache.copy_(_paged_cache(1))  # and the cache is read at replay
    g.replay()
    assert torch.equal(first, _attend(npu, query, cache, table, [1, 2], [60, 61]))
    assert torch.equal(second, _attend(npu, query[:1], cache, table[:1], [1], [62]))

    with pytest.raises(RuntimeError, match="operators that need to be updated"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [1, 1]}] * 3)


def test_one_update_dict_goes_to_every_captured_attention_op(npu_platform):
    npu = npu_platform._npu
    cache, query = _paged_cache(2), torch.randn(2, HEADS, HEAD_DIM)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        outputs = [_attend(npu, query, cache, table, [1, 2], [4, 4]) for _ in range(3)]
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [150, 256]}])
    g.replay()
    expected = _attend(npu, query, cache, table, [1, 2], [150, 256])
    assert all(torch.equal(out, expected) for out in outputs)


def test_forgetting_the_update_gives_the_wrong_attention(npu_platform):
    """The runner's mistake this fake must catch: new context lengths copied
    into tensors or a Python list, but not handed to update()."""
    npu = npu_platform._npu
    cache, query = _paged_cache(3), torch.randn(1, HEADS, HEAD_DIM)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    kv_lens = [10]
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out = _attend(npu, query, cache, table, [1], kv_lens)
    kv_lens[0] = 200  # the list the op was called with: the capture copied it
    g.replay()
    assert not torch.allclose(out, _attend(npu, query, cache, table, [1], [200]))
    assert torch.equal(out, _attend(npu, query, cache, table, [1], [10]))


def test_update_needs_auto_dispatch_capture(npu_platform):
    npu = npu_platform._npu
    cache, query = _paged_cache(4), torch.randn(1, HEADS, HEAD_DIM)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        _attend(npu, query, cache, torch.tensor([[0]], dtype=torch.int32), [1], [5])
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [6]}])


# --- NpuAttention replayed from a captured decode step --------------------------------------------------------


def test_platforms_without_graphs_say_so(npu_platform):
    assert CpuPlatform(CPU).graph_capture() is None
    assert npu_platform.graph_capture().name == "npugraph"


class _Step:
    """Persistent step buffers for `num_seqs` sequences of `rows` new tokens
    (graphs.GraphBuffers, plus the attention's own query / key / value), and
    what the runner copies into them before a replay."""

    def __init__(self, num_seqs: int, rows: int, max_blocks: int, null_block: int):
        n = num_seqs * rows
        self.rows, self.null_block = rows, null_block
        self.query = torch.zeros(n, HEADS, HEAD_DIM)
        self.key, self.value = torch.zeros(n, KV_HEADS, HEAD_DIM), torch.zeros(n, KV_HEADS, HEAD_DIM)
        self.buffers = GraphBuffers(
            num_seqs=num_seqs, rows_per_seq=rows, input_ids=torch.zeros(n, dtype=torch.long),
            positions=torch.zeros(n, dtype=torch.long), slot_mapping=torch.zeros(n, dtype=torch.long),
            block_table=torch.zeros(num_seqs, max_blocks, dtype=torch.int32),
            seq_lens=torch.zeros(num_seqs, dtype=torch.int32),
            query_start=torch.arange(0, n + 1, rows, dtype=torch.int32))

    def fill(self, tables: list[list[int]], contexts: list[int], q, k, v) -> list[int]:
        """The step's sequences, then padding (the null block, a context of its
        own new rows); returns the context lengths a replay is given."""
        b, rows = self.buffers, self.rows
        pad = b.num_seqs - len(tables)
        contexts = contexts + [rows] * pad
        tables = tables + [[self.null_block]] * pad
        b.block_table.fill_(self.null_block)
        slots = []
        for i, (table, context) in enumerate(zip(tables, contexts)):
            b.block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context - rows, context)]
        b.slot_mapping.copy_(torch.tensor(slots))
        b.seq_lens.copy_(torch.tensor(contexts))
        for buffer, values in ((self.query, q), (self.key, k), (self.value, v)):
            buffer.zero_()
            buffer[: len(values)] = values
        return contexts


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("window", [None, 40])
def test_replayed_decode_attention_is_the_eager_kernels(npu_platform, rows, window):
    """A graph captured for 4 sequences replays steps of 3 and of 2 (the rest
    padding on the null block), contexts within one block and across three,
    a window shorter than most; float32 so no layout mistake hides in
    rounding. Each step's attention and K/V writes equal the eager kernel's."""
    from services.worker.platforms.npu import NpuAttention

    torch.manual_seed(rows + (window or 0))
    kernel = NpuAttention(npu_platform._npu, HEADS, KV_HEADS, HEAD_DIM, BLOCK, CPU, scatter_cache_mode=True)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK,
                       dtype=torch.float32)
    eager_pool, graph_pool = KVCachePool(spec, 8, CPU, reserved_blocks=1), KVCachePool(spec, 8, CPU, reserved_blocks=1)
    for cache, copy in ((eager_pool.key_cache, graph_pool.key_cache), (eager_pool.value_cache, graph_pool.value_cache)):
        copy.copy_(cache.normal_())
    step = _Step(num_seqs=4, rows=rows, max_blocks=3, null_block=8)
    inputs = kernel.graph_inputs(step.buffers)
    assert inputs.block_table is step.buffers.block_table
    captured = attention.PagedStep(graph_pool, step.buffers.positions, step.buffers.slot_mapping, kernel, inputs, (),
                                   None)

    capture = npu_platform.graph_capture()
    graph = capture.new_graph()
    memory_before = capture.memory_in_use()
    step.fill([[0]], [rows], *(torch.randn(rows, n, HEAD_DIM) for n in (HEADS, KV_HEADS, KV_HEADS)))
    out = graph.capture(lambda: attention.paged_attention(step.query, step.key, step.value, 0, captured, SCALE, window))
    assert capture.memory_in_use() > memory_before
    graph_pool.key_cache.copy_(eager_pool.key_cache)  # undo the warm-ups' and capture's writes
    graph_pool.value_cache.copy_(eager_pool.value_cache)

    for tables, contexts in [([[3], [5, 1], [2, 7, 4]], [rows + 5, 130, 300]), ([[6, 0], [3]], [256, 100])]:
        n = len(tables) * rows
        q = torch.randn(n, HEADS, HEAD_DIM)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        eager_step = attention.build_paged_step(eager_pool, [rows] * len(tables), [c - rows for c in contexts], tables,
                                                CPU, kernel)
        expected = attention.paged_attention(q, k, v, 0, eager_step, SCALE, window)
        graph.replay(step.fill(tables, contexts, q, k, v))
        torch.testing.assert_close(out[:n], expected, atol=2e-6, rtol=2e-6)
        scheduled = slice(0, 8 * BLOCK)  # the null block is the padding's
        assert torch.equal(graph_pool.key_cache[:, scheduled], eager_pool.key_cache[:, scheduled])
        assert torch.equal(graph_pool.value_cache[:, scheduled], eager_pool.value_cache[:, scheduled])
