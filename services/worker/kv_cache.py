"""The paged KV cache: one preallocated pool of fixed-size blocks, and the
allocator that hands blocks to sequences as they grow.

The pool is two tensors (K and V) of shape [num_layers, num_slots, num_kv_heads,
head_dim], where slot = block * block_size + offset. A sequence's token at
position p lives in slot `block_table[p // block_size] * block_size + p % block_size`.

`BlockAllocator` is deliberately tiny and knows nothing of tensors: the scheduler
is meant to own block tables later, and this class is what moves there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import torch

from services.common.errors import ServiceError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block: what a model needs per cached token, times block_size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        text = config.get_text_config()
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        # 2 = one K and one V entry per token, head and layer.
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCachePool:
    """The preallocated K/V tensors for every layer."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block needs {spec.bytes_per_block} bytes"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * spec.block_size
        shape = (spec.num_layers, self.num_slots, spec.num_kv_heads, spec.head_dim)
        # torch.empty: never-written slots are never read unmasked (see attention.py),
        # and on CPU untouched pages cost no resident memory.
        self.key_cache = torch.empty(shape, dtype=spec.dtype, device=device)
        self.value_cache = torch.empty(shape, dtype=spec.dtype, device=device)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s, %d layers, %d kv heads, head_dim %d)",
            num_blocks, spec.block_size, self.num_slots,
            num_blocks * spec.bytes_per_block / 2**20, str(spec.dtype).removeprefix("torch."),
            spec.num_layers, spec.num_kv_heads, spec.head_dim,
        )

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device) -> KVCachePool:
        return cls(spec, spec.num_blocks_for(budget_bytes), device)


class BlockAllocator:
    """Free list plus one block table per sequence; allocation grows tables on demand."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Pop from the end: low block ids are handed out first, which keeps logs readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def num_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so that `seq_id` can hold `num_tokens` tokens in total."""
        wanted = -(-num_tokens // self.block_size)
        return max(0, wanted - len(self.block_table(seq_id)))

    def allocate(self, num_tokens_by_seq: dict[int, int]) -> None:
        """Grow every listed sequence to hold its token count: all or nothing."""
        needed = {s: self.num_blocks_needed(s, n) for s, n in num_tokens_by_seq.items()}
        total = sum(needed.values())
        if total > len(self._free):
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV cache out of blocks: step needs {total}, {len(self._free)} free "
                f"of {self.num_blocks} ({self.block_size} tokens each)",
            )
        for seq_id, count in needed.items():
            if count:
                table = self._tables.setdefault(seq_id, [])
                table.extend(self._free.pop() for _ in range(count))

    def release(self, seq_id: int) -> int:
        """Return a sequence's blocks to the free list; unknown ids are a no-op."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(reversed(table))
        return len(table)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables
