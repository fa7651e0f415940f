"""The native CPU paged-attention kernel equals the pure-torch SDPA path.

Both run through attention.paged_attention on the same pool and step, so the
kernel is checked exactly where the worker uses it: block tables with blocks
scattered over the pool, contexts that end mid-block, grouped query heads,
sliding windows, and decode rows packed together with prefill chunks (fresh,
and continuing a cached prefix; shorter and longer than the kernel's row tile).
"""
from __future__ import annotations

import pytest
import torch

from services.worker import attention, cpu_kernels
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.platforms.cpu import CpuAttention, CpuPlatform

CPU = torch.device("cpu")


def _kernel(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> CpuAttention:
    kernel = CpuPlatform(CPU).paged_attention(dtype, heads, kv_heads, head_dim, block_size=16)
    assert kernel is not None, "no kernel: is a C compiler installed?"
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (12, 2, 64, 16), (4, 4, 128, 8), (8, 1, 32, 128), (16, 2, 80, 16)],
)
@pytest.mark.parametrize("window", [None, 5, 40])
def test_kernel_matches_sdpa(dtype, heads, kv_heads, head_dim, block_size, window):
    torch.manual_seed(heads * head_dim + block_size)
    spec = KVCacheSpec(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    pool = KVCachePool(spec, 96, CPU)
    pool.key_cache.normal_()
    pool.value_cache.normal_()
    # (new tokens, cached tokens): decodes of contexts 1, 2, block_size,
    # block_size + 1 and a long one; a fresh 3-token prompt, a fresh 21-token
    # prompt, a 19-token chunk after 30 cached tokens, and a 150-token chunk
    # after 100 (its keys span more than one of the kernel's key blocks), and
    # decodes with drafts of 4 and 11 tokens (5 and 12 rows: with bfloat16,
    # together or a row per task, by the heads per KV head) and of 12 (13
    # rows, a tile) after 60, 40 and 33.
    new = [1, 1, 1, 1, 1, 3, 21, 19, 150, 5, 12, 13]
    computed = [0, 1, block_size - 1, block_size, 3 * block_size + 4, 0, 0, 30, 100, 60, 40, 33]
    free = torch.randperm(pool.num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(n + c) // block_size))] for n, c in zip(new, computed)]
    steps = [
        attention.build_paged_step(pool, new, computed, tables, CPU, kernel)
        for kernel in (None, _kernel(dtype, heads, kv_heads, head_dim))
    ]
    rows = sum(new)
    q = torch.randn(rows, heads, head_dim, dtype=dtype)
    k, v = torch.randn(rows, kv_heads, head_dim, dtype=dtype), torch.randn(rows, kv_heads, head_dim, dtype=dtype)
    reference, native = (attention.paged_attention(q, k, v, 1, step, None, window) for step in steps)
    # Both accumulate in float32; bfloat16 outputs may differ by the final rounding.
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(native, reference, atol=tolerance, rtol=tolerance)


def test_kernel_reads_only_the_context():
    """Slots past a sequence's context (never written: NaN here) change nothing."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32)
    pool = KVCachePool(spec, 2, CPU)
    pool.key_cache.fill_(float("nan"))
    pool.value_cache.fill_(float("nan"))
    step = attention.build_paged_step(pool, [1], [0], [[1]], CPU, _kernel(torch.float32, 2, 1, 16))
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    out = attention.paged_attention(q, k, v, 0, step, None, None)
    # One key: softmax weight 1, so each head's output is that key's value.
    torch.testing.assert_close(out, v.expand(1, 2, 16))


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim"),
    [(torch.float16, 4, 4, 64), (torch.float32, 4, 4, 72), (torch.float32, 34, 2, 64)],
)
def test_shapes_without_a_kernel_fall_back(dtype, heads, kv_heads, head_dim):
    """float16, a head size that is not a multiple of 16, more than 16 query heads per KV head."""
    assert cpu_kernels.paged_attention(dtype, heads, kv_heads, head_dim) is None
