"""A torch_npu for tests on CPU: each op the worker's NPU platform calls
(services/worker/platforms/npu.py), as a reference implementation with the
real op's signature, keyword names, layouts and result tuple, that refuses
what the real op would not take the way our code could get wrong (a layout,
a cache mode, an index dtype, a mask). Never a model of speed or of the
kernels' rounding: it computes in float32 and rounds once.

Importing it also installs `torch.npu` (the device namespace torch_npu
registers) as far as the platform uses it. Tensors stay on the CPU, and
torch.npu.is_available() is False: no device is there, and transformers'
own NPU integrations (which this module does not model) stay off; tests
build the NPU platform directly.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

_INT32_MAX = 2147483647


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"torch_npu reference: {message}")


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offset=None, seq_lens=None, cache_mode="PA_NZ", scatter_mode="None"):
    """Writes key/value [T, kv_heads, head_dim] at slot_mapping [T] (slot =
    block * block_size + offset) into caches (num_blocks, block_size, kv_heads,
    head_dim): cache_mode "Norm" only (PA_NZ is a fractal layout)."""
    _check(cache_mode == "Norm", f"cache_mode {cache_mode!r}: the reference lays out 'Norm' only")
    _check(compress_lens is None and compress_seq_offset is None and seq_lens is None, "compression unsupported")
    _check(key.dim() == 3 and key_cache.dim() == 4, "key [T, N, D] and key_cache [blocks, block_size, N, D]")
    _check(key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:],
           f"cache heads/dims {tuple(key_cache.shape)} do not match key {tuple(key.shape)}")
    _check(slot_mapping.dtype == torch.int32 and slot_mapping.shape == key.shape[:1], "slot_mapping int32 [T]")
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    key_cache[slots // block_size, slots % block_size] = key
    value_cache[slots // block_size, slots % block_size] = value


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=_INT32_MAX, next_tokens=_INT32_MAX, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **unsupported):
    """The paged TND case: query [T, N, D]; key/value (num_blocks, block_size,
    kv_heads * D) read through block_table [B, max_blocks] int32;
    actual_seq_lengths the cumulative query ends, actual_seq_lengths_kv each
    sequence's KV length; sparse_mode 3 (causal, aligned to the bottom right
    of each [q, kv] block) or 4 (a band of pre_tokens / next_tokens around
    that diagonal), both with the compressed 2048 x 2048 upper-triangular
    mask. Returns (attention_out [T, N, D], softmax_lse)."""
    _check(not unsupported, f"arguments the reference does not model: {sorted(unsupported)}")
    _check(input_layout == "TND" and block_table is not None, "the reference models paged TND only")
    _check(pse_shift is None, "pse_shift unsupported")
    _check(query.dim() == 3 and query.shape[1] == num_heads, f"query [T, {num_heads}, D], got {tuple(query.shape)}")
    kv_heads = num_key_value_heads or num_heads
    head_dim = query.shape[2]
    _check(key.dim() == 3 and key.shape[1] == block_size and key.shape[2] == kv_heads * head_dim,
           f"key ({'{blocks}'}, {block_size}, {kv_heads * head_dim}), got {tuple(key.shape)}")
    _check(block_table.dtype == torch.int32, "block_table int32")
    _check(sparse_mode in (3, 4), f"sparse_mode {sparse_mode}: the reference models 3 and 4")
    causal = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)
    _check(atten_mask is not None and atten_mask.dtype in (torch.int8, torch.bool, torch.uint8)
           and torch.equal(atten_mask.to(torch.int8).cpu(), causal), "sparse_mode 3/4 take the 2048^2 triu mask")
    if sparse_mode == 3:
        pre_tokens, next_tokens = _INT32_MAX, 0
    ends = list(actual_seq_lengths)
    kv_lens = list(actual_seq_lengths_kv)
    _check(len(ends) == len(kv_lens) == block_table.shape[0] and ends[-1] == query.shape[0],
           "actual_seq_lengths must be cumulative query ends, one per block-table row")
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[0], num_heads, 1, dtype=torch.float32)
    start = 0
    for row, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        n = end - start
        _check(0 < n <= kv_len <= block_table.shape[1] * block_size, "query longer than its KV, or KV past the table")
        blocks = block_table[row, : -(-kv_len // block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        v = value[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        k, v = (t.repeat_interleave(num_heads // kv_heads, dim=1) for t in (k, v))
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(kv_len - n, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        allowed = (k_pos <= q_pos + next_tokens) & (k_pos >= q_pos - pre_tokens)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
        start = end
    return out, lse


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): y = x / rms(x) * gamma over the last dimension."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def npu_swiglu(x, dim=-1):
    """silu(first half) * second half along `dim`."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """x * r1 + rotate_half(x) * r2 on 4-d tensors (r1, r2 broadcast to x)."""
    _check(rotary_mode == "half", "the reference models rotary_mode 'half' only")
    _check(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-d tensors")
    x = input.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(input.dtype)


def _host_memory(device=None) -> tuple[int, int]:
    from services.worker.platforms.base import host_available_memory

    free = host_available_memory()
    return free, free


npu = types.SimpleNamespace(
    is_available=lambda: False,
    device_count=lambda: 1,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    mem_get_info=_host_memory,
)
torch.npu = npu
