"""One paged attention step as the platforms' kernels see it, held to the SDPA
path (attention.py's own, over gathered K/V): the oracle of the CUDA and NPU
attention tests."""
from __future__ import annotations

import dataclasses

import torch

from services.worker import attention
from services.worker.kv_cache import KVCachePool, KVCacheSpec

CPU = torch.device("cpu")


def assert_matches_sdpa(kernel, heads: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                        new: list[int], computed: list[int], window: int | None, dtype: torch.dtype = torch.float32,
                        tolerance: float = 2e-6) -> None:
    """Sequence i feeds new[i] tokens after computed[i] cached ones, its blocks
    scattered over a random float32 pool (no rounding to hide a layout
    mistake): `kernel` runs on a copy of that pool, the oracle on the pool
    itself, so the kernel reads only the K/V it wrote; its attention must
    equal SDPA's, and the two pools must hold the same K/V after.

    With a half-precision `dtype`, the kernel's pool and inputs are the
    oracle's values rounded to it, the oracle still runs in float32:
    `tolerance` (absolute and relative) is then the kernel's own rounding."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=torch.float32)
    pool = KVCachePool(spec, num_blocks, CPU)
    kernel_pool = KVCachePool(dataclasses.replace(spec, dtype=dtype), num_blocks, CPU)
    for cache, copy in ((pool.key_cache, kernel_pool.key_cache), (pool.value_cache, kernel_pool.value_cache)):
        cache.copy_(cache.normal_().to(dtype))
        copy.copy_(cache)
    free = torch.randperm(pool.num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(n + c) // block_size))] for n, c in zip(new, computed)]
    rows = sum(new)
    q = torch.randn(rows, heads, head_dim).to(dtype)
    k, v = torch.randn(rows, kv_heads, head_dim).to(dtype), torch.randn(rows, kv_heads, head_dim).to(dtype)
    oracle = attention.paged_attention(
        q.float(), k.float(), v.float(), 1, attention.build_paged_step(pool, new, computed, tables, CPU), None, window)
    tested = attention.paged_attention(
        q, k, v, 1, attention.build_paged_step(kernel_pool, new, computed, tables, CPU, kernel), None, window)
    assert tested.dtype == dtype
    torch.testing.assert_close(tested.float(), oracle, atol=tolerance, rtol=tolerance)
    assert torch.equal(kernel_pool.key_cache.float(), pool.key_cache)
    assert torch.equal(kernel_pool.value_cache.float(), pool.value_cache)
