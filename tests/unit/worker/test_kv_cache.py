"""KV pool sizing, and the runner's use of scheduler-given block tables."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import ServiceError
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.model_loading import auto_kv_budget
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput


def test_pool_is_sized_from_the_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 2 * 4 * 3 * 8 * 2
    pool = KVCachePool.from_budget(spec, 10 * spec.bytes_per_block + 1, torch.device("cpu"))
    assert pool.num_blocks == 10
    assert pool.key_cache.shape == (2, 40, 3, 8) and pool.value_cache.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="too small"):
        KVCachePool.from_budget(spec, spec.bytes_per_block - 1, torch.device("cpu"))


class _Memory:
    """A backend with a given amount of available memory."""

    def __init__(self, available: int, fraction: float = 0.5):
        self.available, self.kv_memory_fraction = available, fraction

    def available_memory(self) -> int:
        return self.available


def test_automatic_budget_holds_every_sequence_at_full_length_within_the_memory_share():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16)
    # 8 sequences of 10 tokens: 3 blocks each (the last one partial).
    needed = 8 * 3 * spec.bytes_per_block
    assert auto_kv_budget(spec, 8, 10, _Memory(10 * needed)) == needed
    assert auto_kv_budget(spec, 8, 10, _Memory(needed)) == needed // 2  # half of what is available
    assert auto_kv_budget(spec, 8, 10, _Memory(needed, fraction=0.8)) == int(needed * 0.8)


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_pool_memory_is_resident_from_the_start():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
    before = _resident_bytes()
    pool = KVCachePool.from_budget(spec, 64 << 20, torch.device("cpu"))
    # Touched at start: nothing is left to fault in mid-request.
    assert _resident_bytes() - before >= 0.9 * 2 * pool.key_cache.numel() * pool.key_cache.element_size()


def test_runner_allocates_nothing_and_checks_block_tables(runner: ModelRunner):
    """The scheduler owns the blocks: the runner uses the table it is given, and
    refuses one that is too short or points outside the pool."""
    greedy = SamplingParams(temperature=0.0)
    with pytest.raises(ServiceError, match="cannot hold") as info:
        runner.step([SequenceInput(603, [5] * 5, 0, True, greedy, [0])])
    assert info.value.code.name == "INVALID_ARGUMENT"
    with pytest.raises(ServiceError, match="outside"):
        runner.step([SequenceInput(603, [5], 0, True, greedy, [runner.kv_pool.num_blocks])])
    assert 603 not in runner.sequences
    assert not hasattr(runner, "blocks")


def test_block_copies_read_every_source_before_writing():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=3, dtype=torch.float32)
    pool = KVCachePool(spec, 4, torch.device("cpu"))
    for cache, sign in ((pool.key_cache, 1), (pool.value_cache, -1)):
        cache.copy_(sign * torch.arange(cache.numel(), dtype=torch.float32).reshape(cache.shape))
    keys, values = pool.key_cache.clone(), pool.value_cache.clone()
    pool.copy_blocks([(0, 1), (1, 0), (0, 3)])  # a swap, and block 0's old content again
    for cache, before in ((pool.key_cache, keys), (pool.value_cache, values)):
        torch.testing.assert_close(cache[:, 3:6], before[:, 0:3])
        torch.testing.assert_close(cache[:, 0:3], before[:, 3:6])
        torch.testing.assert_close(cache[:, 9:12], before[:, 0:3])
        torch.testing.assert_close(cache[:, 6:9], before[:, 6:9])


def test_runner_refuses_bad_block_copies(runner: ModelRunner):
    num_blocks = runner.kv_pool.num_blocks
    with pytest.raises(ServiceError, match="outside"):
        runner.step([], block_copies=[(0, num_blocks)])
    with pytest.raises(ServiceError, match="twice"):
        runner.step([], block_copies=[(0, 1), (2, 1)])
