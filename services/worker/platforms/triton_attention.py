"""Paged attention and the KV write on CUDA, as Triton kernels.

One launch attends a whole packed step — prefill chunks, chunks over a cached
prefix, decodes and drafted rows mixed — reading K/V in place through the
block tables, the way vLLM's unified Triton attention does
(vllm/attention/ops/triton_unified_attention.py):

- A program owns one KV head and a block of BLOCK_Q query rows of one
  sequence, with the query heads that share that KV head packed into its
  BLOCK_M = BLOCK_Q * heads_per_kv rows (BLOCK_M >= 16, tl.dot's minimum), so
  each K/V tile is read once for all of them.
- The grid depends on shapes only: (T // BLOCK_Q + S, kv_heads) programs,
  an upper bound of the query blocks of any step of T rows over S sequences
  (sum of ceil(n_i / BLOCK_Q) <= T // BLOCK_Q + S). A program finds its
  sequence by a binary search over query_start (sequence s's blocks are
  numbered from query_start[s] // BLOCK_Q + s) and returns at once when it
  lies past that sequence's rows. Nothing is read back to the host, so a
  launch can be captured in a CUDA graph and replayed over new values.
- Keys go by tiles of TILE_N positions, each position's slot looked up in the
  block table (any block size; the platform asks for multiples of 16), from
  the first the window keeps to the last the block's bottom row sees: causal
  masks are aligned to the bottom right of each sequence's [new, context]
  block. Softmax is online, in float32; head_dim is padded to a power of two
  with masks.

Both kernels are built on first use: interpreted for CPU tensors (or under
TRITON_INTERPRET=1), compiled otherwise. triton.jit reads TRITON_INTERPRET
when it decorates, so a kernel decorated at import would be compiled or
interpreted for the whole process by whatever the environment said then.
For the same reason the kernels call only Triton's builtins: tl.max, tl.sum
and tl.zeros are triton.jit functions of Triton's own library, decorated
when triton is imported, and the interpreter cannot call compiled ones.
tl.reduce with the library's combine functions is what tl.max and tl.sum
run, and the interpreter knows those (it reduces with numpy).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.worker.attention import StepSequences
from services.worker.graphs import GraphBuffers

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZE_MULTIPLE = 16
MIN_DOT = 16  # tl.dot's least M, N and K
# Keys per tile: a decode's one row per head reads shorter tiles (vLLM's choice too).
DECODE_TILE, PREFILL_TILE = 16, 32


def triton_fits(dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    """Whether these kernels take a pool of `dtype`, `block_size` and `head_dim`."""
    return dtype in DTYPES and block_size > 0 and block_size % BLOCK_SIZE_MULTIPLE == 0 and head_dim > 0


@dataclass(frozen=True)
class TritonInputs:
    query_start: torch.Tensor  # [S + 1] int32: each sequence's first packed row, then T
    seq_lens: torch.Tensor  # [S] int32: each context, new tokens included
    block_table: torch.Tensor  # [S, max_blocks] int32
    max_query_len: int  # most new rows of any sequence (host-side: it picks the key tile)


def _paged_attention(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    scale, num_seqs,
    query_stride_row, query_stride_head, out_stride_row, out_stride_head,
    cache_stride_slot, cache_stride_head, block_table_stride,
    HEADS_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The sequence: the last whose first block number is <= q_block.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return

    # Row m: query row m // HEADS_PER_KV of the block, head m % HEADS_PER_KV of this KV head's group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    offs_n = tl.arange(0, TILE_N)
    row = local_block * BLOCK_Q + offs_m // HEADS_PER_KV
    head = kv_head * HEADS_PER_KV + offs_m % HEADS_PER_KV
    row_ok = (offs_m < BLOCK_Q * HEADS_PER_KV) & (row < q_len)
    dim_ok = offs_d < HEAD_DIM
    token = (q_start + row).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * query_stride_row + head[:, None] * query_stride_head + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(key_cache_ptr.dtype.element_ty)

    seq_len = tl.load(seq_lens_ptr + seq)
    position = seq_len - q_len + row  # each row's position in its sequence
    # Keys the block's rows see: up to its bottom row's position; from its top
    # row's window on.
    key_end = tl.minimum(seq_len - q_len + local_block * BLOCK_Q + BLOCK_Q, seq_len)
    end_tile = (key_end + TILE_N - 1) // TILE_N
    first_tile = 0
    if WINDOW > 0:
        first_tile = tl.maximum(seq_len - q_len + local_block * BLOCK_Q - WINDOW + 1, 0) // TILE_N
    if INTERPRET:  # never compiled. The interpreter's range() takes int() of
        # its scalars, numpy arrays of shape (1,) there, which numpy >= 2.3
        # refuses; it makes every plain assignment a tensor, not an annotated one.
        first_tile: tl.int32 = first_tile.handle.data.item()
        end_tile: tl.int32 = end_tile.handle.data.item()
    tables = block_table_ptr + seq.to(tl.int64) * block_table_stride
    head_offset = kv_head.to(tl.int64) * cache_stride_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_P], 0.0, tl.float32)
    for tile in range(first_tile, end_tile):
        key_pos = tile * TILE_N + offs_n
        key_ok = key_pos < key_end
        block = tl.load(tables + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
        k = tl.load(key_cache_ptr + slot[None, :] * cache_stride_slot + head_offset + offs_d[:, None],
                    mask=dim_ok[:, None] & key_ok[None, :], other=0.0)  # [HEAD_DIM_P, TILE_N]
        v = tl.load(value_cache_ptr + slot[:, None] * cache_stride_slot + head_offset + offs_d[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [TILE_N, HEAD_DIM_P]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        seen = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] <= position[:, None])
        if WINDOW > 0:
            seen = seen & (key_pos[None, :] > position[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        # A row that has seen no key yet (the window's first tile) subtracts 0:
        # exp(-inf - 0) = 0, where exp(-inf - -inf) would be NaN.
        m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * out_stride_row + head[:, None] * out_stride_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _write_kv(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_row, key_stride_head, value_stride_row, value_stride_head, cache_stride_slot, cache_stride_head,
    KV_HEADS: tl.constexpr, KV_HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """One program per new token: its [kv_heads, head_dim] K and V to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a row that writes nowhere
        return
    heads = tl.arange(0, KV_HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    ok = (heads < KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * key_stride_row + heads * key_stride_head + dims, mask=ok)
    v = tl.load(value_ptr + token * value_stride_row + heads * value_stride_head + dims, mask=ok)
    destination = slot * cache_stride_slot + heads * cache_stride_head + dims
    tl.store(key_cache_ptr + destination, k.to(key_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(value_cache_ptr + destination, v.to(value_cache_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _kernels(interpret: bool):
    """(attention, KV write), decorated in the mode asked for, whatever
    TRITON_INTERPRET says (the scope puts it back after)."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        # num_seqs changes every step: not worth a compiled variant for 1.
        return triton.jit(_paged_attention, do_not_specialize=["num_seqs"]), triton.jit(_write_kv)


def kernels_for(device: torch.device):
    return _kernels(device.type == "cpu" or triton.knobs.runtime.interpret)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _padded(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


class TritonAttention:
    """attention.AttentionKernel on the Triton kernels above."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = (num_heads, num_kv_heads, head_dim,
                                                                              block_size)
        self.heads_per_kv = num_heads // num_kv_heads
        self.block_m = _padded(self.heads_per_kv)
        self.block_q = self.block_m // self.heads_per_kv

    def prepare(self, sequences: StepSequences, device: torch.device) -> TritonInputs:
        query_start = torch.zeros(len(sequences.num_new) + 1, dtype=torch.int32)
        torch.cumsum(sequences.num_new, 0, out=query_start[1:])
        return TritonInputs(
            query_start=query_start.to(device, non_blocking=True),
            seq_lens=sequences.context_lens.to(torch.int32).to(device, non_blocking=True),
            block_table=sequences.block_tables.to(torch.int32).to(device, non_blocking=True),
            max_query_len=int(sequences.num_new.max()),
        )

    def graph_inputs(self, buffers: GraphBuffers) -> TritonInputs:
        return TritonInputs(buffers.query_start, buffers.seq_lens, buffers.block_table, buffers.rows_per_seq)

    def grid(self, num_rows: int, num_seqs: int) -> tuple[int, int]:
        """Programs for a step of `num_rows` rows over `num_seqs` sequences: shapes only."""
        return num_rows // self.block_q + num_seqs, self.num_kv_heads

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
        kv_heads, head_dim = key.shape[1], key.shape[2]
        write = kernels_for(key.device)[1]
        write[(key.shape[0],)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), key_cache.stride(0), key_cache.stride(1),
            KV_HEADS=kv_heads, KV_HEADS_P=triton.next_power_of_2(kv_heads), HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim),
        )

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 inputs: TritonInputs, block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        query = _last_dim_contiguous(query)
        assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
        num_rows = query.shape[0]
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        attend = kernels_for(query.device)[0]
        attend[self.grid(num_rows, inputs.seq_lens.shape[0])](
            out, query, key_cache, value_cache, inputs.block_table, inputs.seq_lens, inputs.query_start,
            scale, inputs.seq_lens.shape[0],
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), inputs.block_table.stride(0),
            HEADS_PER_KV=self.heads_per_kv, HEAD_DIM=self.head_dim, HEAD_DIM_P=_padded(self.head_dim),
            BLOCK_SIZE=block_size, BLOCK_M=self.block_m, BLOCK_Q=self.block_q,
            TILE_N=DECODE_TILE if inputs.max_query_len == 1 else PREFILL_TILE,
            WINDOW=sliding_window or 0,
            # float32 pools: full-precision products, not TF32's 10-bit mantissa.
            DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
            INTERPRET=isinstance(attend, InterpretedFunction),
        )
        return out
