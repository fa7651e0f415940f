"""KV block accounting and pool sizing."""
from __future__ import annotations

import pytest
import torch

from services.common.errors import ServiceError
from services.worker.kv_cache import BlockAllocator, KVCachePool, KVCacheSpec
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput


def test_blocks_grow_on_demand_and_return_on_release():
    blocks = BlockAllocator(num_blocks=10, block_size=4)
    blocks.allocate({1: 5, 2: 4})  # 2 blocks + 1 block
    assert len(blocks.block_table(1)) == 2 and len(blocks.block_table(2)) == 1
    assert blocks.num_free_blocks == 7
    blocks.allocate({1: 8, 2: 5})  # seq 1 still fits in 2 blocks; seq 2 needs a 2nd
    assert len(blocks.block_table(1)) == 2 and len(blocks.block_table(2)) == 2
    assert blocks.num_free_blocks == 6
    assert not set(blocks.block_table(1)) & set(blocks.block_table(2))
    assert blocks.release(1) == 2
    assert blocks.release(1) == 0  # releasing twice (or an unknown id) is harmless
    blocks.release(2)
    assert blocks.num_free_blocks == 10


def test_out_of_blocks_is_resource_exhausted_and_all_or_nothing():
    blocks = BlockAllocator(num_blocks=3, block_size=4)
    blocks.allocate({1: 4})
    with pytest.raises(ServiceError, match="out of blocks") as info:
        blocks.allocate({2: 4, 3: 5})  # needs 3, 2 free
    assert info.value.code.name == "RESOURCE_EXHAUSTED"
    assert blocks.num_free_blocks == 2
    assert blocks.block_table(2) == [] and not blocks.has(3)


def test_pool_is_sized_from_the_budget():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 2 * 4 * 3 * 8 * 2
    pool = KVCachePool.from_budget(spec, 10 * spec.bytes_per_block + 1, torch.device("cpu"))
    assert pool.num_blocks == 10
    assert pool.key_cache.shape == (2, 40, 3, 8) and pool.value_cache.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="too small"):
        KVCachePool.from_budget(spec, spec.bytes_per_block - 1, torch.device("cpu"))


def test_runner_frees_every_block_and_reports_exhaustion(runner: ModelRunner):
    greedy = SamplingParams(temperature=0.0)
    free = runner.num_free_blocks
    runner.step([SequenceInput(601, list(range(10, 30)), 0, True, greedy),
                 SequenceInput(602, list(range(40, 45)), 0, True, greedy)])
    assert runner.num_free_blocks == free - 5 - 2  # 20 and 5 tokens in blocks of 4
    runner.step([SequenceInput(602, [7], 5, True)], release_seq_ids=[601])
    assert runner.num_free_blocks == free - 2
    too_long = (free + 1) * runner.blocks.block_size
    with pytest.raises(ServiceError) as info:
        runner.step([SequenceInput(603, [5] * too_long, 0, True, greedy)])
    assert info.value.code.name == "RESOURCE_EXHAUSTED"
    runner.step([], release_seq_ids=[602, 603])
    assert runner.num_free_blocks == free
