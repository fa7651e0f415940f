"""Ascend graphs on CPU: the fake torch_npu's NPUGraph (tests/fake_npu/torch_npu/_graphs.py)
held to the real capture/replay/update semantics."""
from __future__ import annotations

import gc
import importlib
import sys
from pathlib import Path

import pytest
import torch

FAKE_NPU = Path(__file__).resolve().parents[2] / "fake_npu"
CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 128
SCALE = HEAD_DIM ** -0.5


@pytest.fixture(scope="module")
def npu_platform():
    """test_moe.py's way: the fake stays imported, and so does its torch.npu,
    set again where another module's fixture removed it (the import sets it
    once per process); its is_available() is False, so the platform is still
    never selected."""
    sys.path.insert(0, str(FAKE_NPU))
    try:
        torch.npu = importlib.import_module("torch_npu").npu
        from services.worker.platforms.npu import NpuPlatform

        yield NpuPlatform(CPU)
    finally:
        sys.path.remove(str(FAKE_NPU))


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
