"""Paged attention over a packed batch, registered with transformers as
"stormserve_paged" so any HF causal LM runs on the worker's KV pool unchanged.

The model sees one packed row: input_ids [1, T] holds every sequence's new
tokens back to back (prefill chunks and single decode tokens mixed). The step's
layout — which rows belong to which sequence, their KV slots and context
lengths — is a `PagedStep`, built once per step and handed to every layer
through the forward kwarg `paged_step` (transformers passes unknown forward
kwargs down to the attention function).

`paged_attention` is the one entry point; the HF entry point and the lean
Llama-family path (decoder.py) both call it. Per layer it writes the new K/V
into the pool by slot, then attends:
- on CPU, every row of the step in one call of the native kernel
  (cpu_kernels.py), which reads K/V in place through the block tables;
- elsewhere, and as the reference the kernel is tested against, in plain torch:
  all decode tokens (one new token per sequence) in ONE batched SDPA call over
  K/V gathered through their block tables and padded to the longest context
  with a mask, and each prefill chunk in its own SDPA call, causal within the
  chunk and over its cached prefix.
Because this implementation is not in transformers' AttentionMaskInterface,
transformers builds no [T, T] mask for it (attention_mask arrives as None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.worker.graphs import GraphBuffers
from services.worker.kv_cache import KVCachePool

ATTENTION_NAME = "stormserve_paged"


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with several new tokens: rows [start, end) of the packed batch."""

    start: int
    end: int
    num_computed: int
    # Slots of the whole context (cached prefix + new tokens); None when there is no
    # cached prefix, so the fresh K/V of the chunk are attended directly.
    context_slots: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """All sequences with exactly one new token, attended together."""

    rows: torch.Tensor  # [B] packed row of each decode token
    context_slots: torch.Tensor  # [B, L] slots, padded by repeating the last real slot
    key_positions: torch.Tensor  # [1, L] 0..L-1
    query_positions: torch.Tensor  # [B, 1] position of the new token (= context length - 1)
    mask: torch.Tensor  # [B, 1, 1, L] True where a key is part of the context


@dataclass(frozen=True)
class StepSequences:
    """The step's sequences, one entry each, on the host: what a kernel
    prepares its per-step inputs from."""

    block_tables: torch.Tensor  # [S, max_blocks] int64, short tables padded with block 0
    starts: torch.Tensor  # [S] packed row of the sequence's first new token
    num_new: torch.Tensor  # [S] its new tokens
    context_lens: torch.Tensor  # [S] its context, new tokens included


class AttentionKernel(Protocol):
    """A platform's paged attention over one layer of the pool."""

    def prepare(self, sequences: StepSequences, device: torch.device) -> Any:
        """Once per step: the kernel's inputs for every layer of it, on `device`."""

    def graph_inputs(self, buffers: GraphBuffers) -> Any:
        """The kernel's inputs for a captured decode step (graphs.py), read from
        the persistent `buffers` at replay: views of them, never copies, and no
        value of theirs read on the host."""

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's new K/V [T, kv_heads, head_dim] into the layer's cache
        [num_slots, kv_heads, head_dim] at `slot_mapping` [T]."""

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, inputs: Any,
                 block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        """query [T, heads, head_dim] packed as the step lays rows out -> [T, heads, head_dim]."""


def write_kv_by_slot(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


@dataclass(frozen=True)
class PagedStep:
    """Everything the attention function needs to know about one packed step."""

    pool: KVCachePool
    positions: torch.Tensor  # [T] position of every packed token
    slot_mapping: torch.Tensor  # [T] pool slot each new token's K/V is written to
    kernel: AttentionKernel | None  # None: the step attends through SDPA, as laid out below
    kernel_inputs: Any  # what kernel.prepare made of the step; None without a kernel
    prefills: tuple[PrefillChunk, ...]
    decode: DecodeBatch | None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_paged_step(
    pool: KVCachePool,
    num_new_tokens: list[int],
    num_computed_tokens: list[int],
    block_tables: list[list[int]],
    device: torch.device,
    kernel: AttentionKernel | None = None,
) -> PagedStep:
    """Lay out one step: sequences in the given order, their new tokens back to back.

    Every block table must already cover num_computed + num_new tokens. Without
    a kernel, the SDPA path's prefill chunks and decode batch are laid out too.
    """
    block_size = pool.spec.block_size
    num_seqs = len(num_new_tokens)
    max_blocks = max(len(t) for t in block_tables)
    # Short tables are padded with block 0; padded entries are never looked up.
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
    new = torch.tensor(num_new_tokens, dtype=torch.long)
    computed = torch.tensor(num_computed_tokens, dtype=torch.long)
    context = computed + new

    # Row -> (sequence, position), vectorised so big prefills cost no Python loop.
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), new)
    starts = torch.cumsum(new, 0) - new
    positions = torch.arange(int(new.sum())) - starts[seq_of_row] + computed[seq_of_row]
    slot_mapping = _slots(tables[seq_of_row], positions, block_size)
    if kernel is not None:
        inputs = kernel.prepare(StepSequences(tables, starts, new, context), device)
        return PagedStep(pool, positions.to(device), slot_mapping.to(device), kernel, inputs, (), None)

    prefills = []
    for i in range(num_seqs):
        if num_new_tokens[i] > 1:
            start = int(starts[i])
            context_slots = None
            if num_computed_tokens[i] > 0:
                context_positions = torch.arange(int(context[i]))
                row_tables = tables[i].expand(len(context_positions), -1)
                context_slots = _slots(row_tables, context_positions, block_size).to(device)
            end = start + num_new_tokens[i]
            prefills.append(PrefillChunk(start, end, num_computed_tokens[i], context_slots))

    decode = None
    decode_seqs = (new == 1).nonzero().flatten()
    if len(decode_seqs):
        decode = decode_batch(tables[decode_seqs], starts[decode_seqs], context[decode_seqs], block_size, device)
    return PagedStep(pool, positions.to(device), slot_mapping.to(device), None, None, tuple(prefills), decode)


def decode_batch(tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, block_size: int,
                 device: torch.device) -> DecodeBatch:
    """The SDPA layout of sequences with one new token each: their block
    tables [B, max_blocks], packed rows [B] and context lengths [B]."""
    key_positions = torch.arange(int(lengths.max()))[None, :]
    # Padding reuses each sequence's last real slot: it was written, so it holds
    # finite values (masked-out NaN garbage would still poison softmax @ V).
    padded_positions = torch.minimum(key_positions, lengths[:, None] - 1)
    rows_tables = tables[:, None, :].expand(-1, key_positions.shape[1], -1)
    return DecodeBatch(
        rows=rows.to(device),
        context_slots=_slots(rows_tables, padded_positions, block_size).to(device),
        key_positions=key_positions.to(device),
        query_positions=(lengths - 1)[:, None].to(device),
        mask=(key_positions < lengths[:, None])[:, None, None, :].to(device),
    )


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each position, given the (row-aligned) block table it belongs to."""
    blocks = torch.gather(tables, -1, (positions // block_size)[..., None])[..., 0]
    return blocks * block_size + positions % block_size


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_step: PagedStep | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface entry point; returns [1, T, heads, head_dim] and no weights."""
    if paged_step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the forward kwarg paged_step")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or hasattr(module, "sinks"):
        raise NotImplementedError(f"{ATTENTION_NAME}: logit softcapping / attention sinks are not supported")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} expects one packed row, got batch {query.shape[0]}")
    out = paged_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        module.layer_idx, paged_step, scaling, sliding_window,
    )
    return out[None], None


def paged_attention(
    query: torch.Tensor,  # [T, heads, head_dim]
    key: torch.Tensor,  # [T, kv_heads, head_dim]
    value: torch.Tensor,
    layer: int,
    step: PagedStep,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write the step's new K/V into layer `layer` of the pool, attend; returns [T, heads, head_dim]."""
    key_cache = step.pool.key_cache[layer]  # [num_slots, kv_heads, head_dim]
    value_cache = step.pool.value_cache[layer]
    if step.kernel is not None:
        step.kernel.write_kv(key_cache, value_cache, key, value, step.slot_mapping)
        return step.kernel(
            query, key_cache, value_cache, step.kernel_inputs, step.pool.spec.block_size,
            query.shape[-1] ** -0.5 if scaling is None else scaling, sliding_window,
        )
    write_kv_by_slot(key_cache, value_cache, key, value, step.slot_mapping)

    gqa = query.shape[1] != key.shape[1]
    out = query.new_empty(query.shape)
    if step.decode is not None:
        d = step.decode
        o = decode_sdpa(query.index_select(0, d.rows), key_cache, value_cache, d, scaling, sliding_window)
        out.index_copy_(0, d.rows, o)
    for chunk in step.prefills:
        q = query[chunk.start : chunk.end].transpose(0, 1)[None]  # [1, heads, n, dim]
        if chunk.context_slots is None:
            k = key[chunk.start : chunk.end].transpose(0, 1)[None]
            v = value[chunk.start : chunk.end].transpose(0, 1)[None]
        else:
            k = _gather(key_cache, chunk.context_slots).permute(1, 0, 2)[None]
            v = _gather(value_cache, chunk.context_slots).permute(1, 0, 2)[None]
        mask = _prefill_mask(chunk, k.shape[2], sliding_window, query.device)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


def decode_sdpa(
    query: torch.Tensor,  # [B, heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    d: DecodeBatch,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Decode attention in plain torch: K/V gathered through the block tables."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    # The query heads that share a KV head stand in for SDPA's query rows: one
    # [heads / kv_heads, L] attention per (sequence, KV head) instead of
    # `heads` attentions of one row each. The same math (and the same error
    # against float32); the bfloat16 CPU kernel ran 4.8 times faster on 32
    # decodes of the bundled model.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k = _gather(key_cache, d.context_slots).permute(0, 2, 1, 3)  # [B, kv_heads, L, dim]
    v = _gather(value_cache, d.context_slots).permute(0, 2, 1, 3)
    mask = d.mask
    if sliding_window is not None:
        mask = mask & (d.key_positions > d.query_positions - sliding_window)[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(num_seqs, num_heads, head_dim)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] — via index_select on the flat index, several times faster on CPU."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])


def _prefill_mask(
    chunk: PrefillChunk, context_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """None when SDPA's own is_causal is exact (no cached prefix, no effective window)."""
    num_new = chunk.end - chunk.start
    windowed = sliding_window is not None and sliding_window < context_len
    if chunk.num_computed == 0 and not windowed:
        return None
    query_positions = torch.arange(chunk.num_computed, context_len, device=device)[:, None]
    key_positions = torch.arange(context_len, device=device)[None, :]
    mask = key_positions <= query_positions
    if windowed:
        mask &= key_positions > query_positions - sliding_window
    return mask.view(1, 1, num_new, context_len)


def register() -> str:
    """Make the implementation known to transformers; returns its name for attn_implementation."""
    from transformers import AttentionInterface  # its module pulls in transformers' modeling code

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
