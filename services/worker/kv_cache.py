"""The paged KV cache: one preallocated pool of fixed-size blocks.

The pool is two tensors (K and V) of shape [num_layers, num_slots, num_kv_heads,
head_dim], where slot = block * block_size + offset. A sequence's token at
position p lives in slot `block_table[p // block_size] * block_size + p % block_size`.

An MLA model (DeepSeek-V3/R1; spec.latent) caches no K/V per head: per token
and layer one latent of kv_lora_rank + qk_rope_head_dim values (the normed
compressed KV c_kv and the rotated shared rope key k_pe, mla.py), held as two
tensors [num_layers, num_slots, kv_lora_rank] and [..., qk_rope_head_dim] with
the same slots.

Block tables are not kept here: the scheduler owns them (allocation, prefix
sharing, freeing) and sends each sequence's table with every step.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a CPU tensor with 2 MiB pages where it can (transparent
    huge pages in `madvise` or `always` mode; elsewhere nothing happens).

    Decode attention reads every sequence's blocks, scattered over the pool,
    each step: with 4 KiB pages nearly every block costs a TLB miss. 32 decodes
    over 250-token contexts on a Zen 5 VM: 12.6 -> 11.2 ms per step."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (end - aligned) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    except (OSError, AttributeError):  # not Linux: small pages it is
        pass


# Model types whose MLA is the math mla.py implements (transformers' DeepseekV3Attention):
# DeepSeek-V3, R1 and the checkpoints that reuse their model type (Kimi K2). Others
# with kv_lora_rank differ (deepseek_v2's complex rotary, deepseek_v32's sparse
# indexer) and are refused rather than cached in a layout nothing reads.
MLA_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class LatentLayout:
    """What an MLA model caches per token and layer instead of K/V per head."""

    kv_lora_rank: int  # c_kv: the RMS-normed compressed KV
    rope_dim: int  # k_pe: the rotated rope key all heads share
    # Values per token and layer that K and V per head would take instead,
    # num_heads x (qk_nope + qk_rope + v_head_dim): for the log.
    per_head_values: int


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one block: what a model needs per cached token, times block_size.

    An MLA spec (`latent`) has one "KV head" of head_dim = kv_lora_rank + rope_dim
    values and no V, as vLLM's MLA spec has: every query head reads the same latent."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    latent: LatentLayout | None = None

    def __post_init__(self) -> None:
        if self.latent is not None and (
                self.num_kv_heads != 1 or self.head_dim != self.latent.kv_lora_rank + self.latent.rope_dim):
            # The latent is not split by heads (tensor parallelism replicates it).
            raise ValueError(f"an MLA cache holds one latent of {self.latent.kv_lora_rank} + "
                             f"{self.latent.rope_dim} values per token, not {self.num_kv_heads} x {self.head_dim}")

    @classmethod
    def from_model_config(cls, config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        text = config.get_text_config()
        if getattr(text, "kv_lora_rank", None):
            return cls.for_mla(text, block_size, dtype)
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)

    @classmethod
    def for_mla(cls, text_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The latent cache of an MLA model (a config with kv_lora_rank); ValueError
        for a model type whose MLA is not DeepSeek-V3's."""
        model_type = getattr(text_config, "model_type", None)
        if model_type not in MLA_MODEL_TYPES:
            raise ValueError(f"multi-head latent attention of {model_type!r} models is not supported "
                             f"(only {', '.join(MLA_MODEL_TYPES)})")
        rank, rope_dim = text_config.kv_lora_rank, text_config.qk_rope_head_dim
        per_head = text_config.num_attention_heads * (
            text_config.qk_nope_head_dim + rope_dim + text_config.v_head_dim)
        return cls(text_config.num_hidden_layers, 1, rank + rope_dim, block_size, dtype,
                   LatentLayout(rank, rope_dim, per_head))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        # 2 = one K and one V entry per token, head and layer; a latent has no V.
        entries = 1 if self.latent is not None else 2
        return entries * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


class KVCachePool:
    """The preallocated cache tensors for every layer: key_cache and value_cache
    [num_layers, num_slots, num_kv_heads, head_dim]; for an MLA spec instead
    latent_cache [num_layers, num_slots, kv_lora_rank] and rope_cache
    [num_layers, num_slots, rope_dim]. `caches` holds whichever pair it has."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, reserved_blocks: int = 0):
        """`num_blocks` the scheduler's (ids 0 to num_blocks - 1); `reserved_blocks`
        more past them are the worker's own (graphs.py's null block)."""
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block needs {spec.bytes_per_block} bytes"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_slots = (num_blocks + reserved_blocks) * spec.block_size
        if spec.latent is None:
            shape = (spec.num_layers, self.num_slots, spec.num_kv_heads, spec.head_dim)
            self.key_cache = torch.empty(shape, dtype=spec.dtype, device=device)
            self.value_cache = torch.empty(shape, dtype=spec.dtype, device=device)
            self.caches: tuple[torch.Tensor, ...] = (self.key_cache, self.value_cache)
        else:
            # Two tensors rather than one of head_dim values: Ascend's fused cache
            # write and MLA attention take c_kv and k_pe as separate contiguous
            # caches (as vllm-ascend lays them out); the torch path reads either.
            self.latent_cache = torch.empty((spec.num_layers, self.num_slots, spec.latent.kv_lora_rank),
                                            dtype=spec.dtype, device=device)
            self.rope_cache = torch.empty((spec.num_layers, self.num_slots, spec.latent.rope_dim),
                                          dtype=spec.dtype, device=device)
            self.caches = (self.latent_cache, self.rope_cache)
        if device.type == "cpu":
            # Touched now, in huge pages where the kernel has them: the worker holds
            # its whole budget from the start (a machine short of memory fails here,
            # not mid-request), and no step waits on page faults and compaction.
            for cache in self.caches:
                _advise_huge_pages(cache)
                cache.zero_()
        dtype_name = str(spec.dtype).removeprefix("torch.")
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB, %d bytes per token (%s, %d layers, %s)",
            num_blocks, spec.block_size, self.num_slots, num_blocks * spec.bytes_per_block / 2**20,
            spec.bytes_per_token, dtype_name, spec.num_layers,
            f"{spec.num_kv_heads} kv heads, head_dim {spec.head_dim}" if spec.latent is None else
            f"MLA latent {spec.latent.kv_lora_rank} + rope {spec.latent.rope_dim}",
        )
        if spec.latent is not None:
            per_head_bytes = spec.bytes_per_token // spec.head_dim * spec.latent.per_head_values
            log.info("KV cache: K/V per head would take %d values per token and layer, %d bytes per token "
                     "(%.1f times the latent), %d tokens in this pool's memory",
                     spec.latent.per_head_values, per_head_bytes, per_head_bytes / spec.bytes_per_token,
                     num_blocks * spec.bytes_per_block // per_head_bytes)

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device) -> KVCachePool:
        return cls(spec, spec.num_blocks_for(budget_bytes), device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (src, dst) block's slots in every layer; every source is read
        before any destination is written, so a block may be both."""
        if not copies:
            return
        size = self.spec.block_size
        device = self.caches[0].device
        offsets = torch.arange(size, device=device)
        src, dst = (
            (torch.tensor(blocks, device=device)[:, None] * size + offsets).flatten() for blocks in zip(*copies)
        )
        for cache in self.caches:
            cache[:, dst] = cache[:, src]  # advanced indexing: the right side is a copy
