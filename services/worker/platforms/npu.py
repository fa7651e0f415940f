"""Ascend NPU through torch_npu, written against the ops vllm-ascend calls
(torch_npu 2.x schemas); imported only where torch_npu is installed.

- KV write: npu_scatter_pa_kv_cache(key=, value=, key_cache=, value_cache=,
  slot_mapping=, cache_mode="Norm") into caches viewed as (num_blocks,
  block_size, kv_heads, head_dim); "Norm" because the op's default, PA_NZ,
  is a different (fractal) layout. cache_mode came with torch_npu 26.0.0
  (op-plugin's schema); before it the op writes PA_NZ only, so with an older
  torch_npu the K/V are written by slot in torch (index_copy_) instead.
- Attention, prefill chunks and decodes in one call:
  npu_fused_infer_attention_score with input_layout="TND" (query [T, heads,
  head_dim]), K/V as (num_blocks, block_size, kv_heads * head_dim) with the
  block table, actual_seq_lengths = each sequence's cumulative query end,
  actual_seq_lengths_kv = each context length, and sparse_mode=3 (causal,
  aligned to the bottom right of every sequence's [new, context] block) with
  the 2048 x 2048 int8 upper-triangular mask that mode takes. A sliding window
  is sparse_mode=4 (a band of pre_tokens before and next_tokens after). A
  step of one new token per sequence runs the op's decode branch, where
  sparse_mode, pre_tokens and next_tokens are documented as invalid (the
  band would be dropped): its windowed layers attend through attention.py's
  SDPA over the window instead.
  The fused paged path takes block sizes of 128 to 512, multiples of 128, and
  float16 / bfloat16; other pools attend through attention.py's SDPA path.
- npu_rms_norm, npu_swiglu (silu of the first half times the second), and
  npu_rotary_mul (rotate-half, 4-d inputs) for the lean decoder's layer ops.
- torch.npu.set_device / synchronize / mem_get_info; HCCL collectives.

Never run on an NPU in this repository: tests/fake_npu holds a torch_npu whose
ops are reference implementations on CPU with these signatures and layouts,
and the bundled model must give the CPU platform's logits through this file.
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from services.worker.attention import DecodeBatch, StepSequences, decode_batch, decode_sdpa, write_kv_by_slot
from services.worker.platforms.base import Platform

log = logging.getLogger(__name__)

# sparse_mode 3/4 take this compressed causal mask, whatever the sequence lengths.
MASK_SIZE = 2048
FUSED_BLOCK_SIZES = range(128, 513, 128)
FUSED_DTYPES = (torch.float16, torch.bfloat16)
CAUSAL, BAND = 3, 4


def import_torch_npu():
    """torch_npu registers the "npu" device (torch.npu) on import."""
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    try:
        import_torch_npu()
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def takes_cache_mode(scatter_op) -> bool:
    """Whether npu_scatter_pa_kv_cache (torch.ops.npu's, with its schema) has cache_mode."""
    return any(argument.name == "cache_mode" for argument in scatter_op.default._schema.arguments)


@dataclass
class NpuStepInputs:
    block_table: torch.Tensor  # [S, max_blocks] int32 on the device
    actual_seq_lengths: list[int]  # cumulative query ends, TND's convention
    actual_seq_lengths_kv: list[int]  # each sequence's context, new tokens included
    sequences: StepSequences  # on the host
    block_size: int
    device: torch.device

    @property
    def decode_only(self) -> bool:
        return int(self.sequences.num_new.max()) == 1

    @functools.cached_property
    def decode(self) -> DecodeBatch:
        """A decode-only step as attention.py's SDPA path lays it out, built
        once per step where a windowed layer needs it."""
        s = self.sequences
        return decode_batch(s.block_tables, s.starts, s.context_lens, self.block_size, self.device)


class NpuAttention:
    def __init__(self, torch_npu, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device, scatter_cache_mode: bool):
        """`scatter_cache_mode`: whether this torch_npu's npu_scatter_pa_kv_cache
        takes cache_mode (takes_cache_mode); without it K/V are written by slot."""
        self._npu = torch_npu
        self._num_heads, self._num_kv_heads, self._head_dim = num_heads, num_kv_heads, head_dim
        self._block_size = block_size
        self._scatter = scatter_cache_mode
        # 1 = masked: the strict upper triangle.
        self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), diagonal=1)

    def prepare(self, sequences: StepSequences, device: torch.device) -> NpuStepInputs:
        return NpuStepInputs(
            block_table=sequences.block_tables.to(device=device, dtype=torch.int32),
            actual_seq_lengths=torch.cumsum(sequences.num_new, 0).tolist(),
            actual_seq_lengths_kv=sequences.context_lens.tolist(),
            sequences=sequences,
            block_size=self._block_size,
            device=device,
        )

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, self._block_size, self._num_kv_heads, self._head_dim)

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not self._scatter:
            write_kv_by_slot(key_cache, value_cache, key, value, slot_mapping)
            return
        self._npu.npu_scatter_pa_kv_cache(
            key=key.contiguous(), value=value.contiguous(),
            key_cache=self._blocks(key_cache), value_cache=self._blocks(value_cache),
            slot_mapping=slot_mapping.to(torch.int32), cache_mode="Norm",
        )

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 inputs: NpuStepInputs, block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is not None and inputs.decode_only:  # the decode branch would drop the band
            return decode_sdpa(query, key_cache, value_cache, inputs.decode, scale, sliding_window)
        band = {} if sliding_window is None else {
            "sparse_mode": BAND, "pre_tokens": sliding_window - 1, "next_tokens": 0}
        out, _ = self._npu.npu_fused_infer_attention_score(
            query.contiguous(),
            key_cache.view(-1, block_size, self._num_kv_heads * self._head_dim),
            value_cache.view(-1, block_size, self._num_kv_heads * self._head_dim),
            atten_mask=self._mask,
            block_table=inputs.block_table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=inputs.actual_seq_lengths,
            actual_seq_lengths_kv=inputs.actual_seq_lengths_kv,
            num_heads=self._num_heads,
            num_key_value_heads=self._num_kv_heads,
            scale=scale,
            **({"sparse_mode": CAUSAL} | band),
        )
        return out


class NpuLayerOps:
    def __init__(self, torch_npu):
        self._npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_swiglu(gate_up, dim=-1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, head_dim] as one BSND batch; cos, sin [rows, head_dim]."""
        return self._npu.npu_rotary_mul(x.contiguous()[None], cos[None, :, None, :], sin[None, :, None, :])[0]


class NpuPlatform(Platform):
    name: ClassVar[str] = "npu"
    dist_backend: ClassVar[str] = "hccl"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._npu = import_torch_npu()
        self._scatter_cache_mode = takes_cache_mode(torch.ops.npu.npu_scatter_pa_kv_cache)
        if not self._scatter_cache_mode:
            log.warning("torch_npu's npu_scatter_pa_kv_cache has no cache_mode (torch_npu before 26.0.0) and "
                        "writes the PA_NZ layout only: K/V are written by slot in torch")

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def available_memory(self) -> int:
        return torch.npu.mem_get_info(self.device)[0]  # type: ignore[attr-defined]

    def set_device(self, local_rank: int) -> None:
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]

    def layer_ops(self, dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int) -> NpuLayerOps:
        return NpuLayerOps(self._npu)

    def paged_attention(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int) -> NpuAttention | None:
        if block_size not in FUSED_BLOCK_SIZES or dtype not in FUSED_DTYPES:
            log.warning("the fused NPU attention takes %s pools with blocks of 128 to 512 tokens (multiples of "
                        "128); %s with %d-token blocks attends through SDPA", FUSED_DTYPES, dtype, block_size)
            return None
        return NpuAttention(self._npu, num_heads, num_kv_heads, head_dim, block_size, self.device,
                            self._scatter_cache_mode)
