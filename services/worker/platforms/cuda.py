"""CUDA without vLLM: torch's own flash-attention varlen path over the paged pool.

torch.nn.attention.varlen.varlen_attn (torch 2.13) takes the query packed
[T, heads, head_dim] with cumulative starts (cu_seq_q), and with block_table
[S, max_pages] int32 and seqused_k [S] int32 reads K/V from a pool of pages
(num_pages, page_size, kv_heads, head_dim) — the per-layer view of our pool.
It calls aten._flash_attention_forward, whose varlen entry (flash_api.cpp,
mha_varlen_fwd) takes paged K/V only with a page size divisible by 256, and
float16 / bfloat16 only (Ampere or newer); causal masks are aligned to the
bottom right, so a prefill chunk over a cached prefix is one call with the
decodes. Other pools attend through attention.py's SDPA path over gathered
K/V, which is also the oracle the plumbing here is tested against (on CPU,
with a reference of varlen_attn's semantics: tests/unit/worker/test_cuda_attention.py).

Where torch's varlen_attn lacks the paged arguments (torch 2.11 has no
block_table, seqused_k or enable_gqa), every pool attends through SDPA.

Mixture-of-experts layers run their experts on torch's grouped GEMM
(F.grouped_mm / torch._grouped_mm, bfloat16, sm80+ / sm90) where it exists.
DeepSeek's FP8 blocks run on the block-scaled FP8 GEMM (cuda_fp8.py). Like
the rest of this file, never run on a GPU here.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from services.worker.attention import StepSequences, write_kv_by_slot
from services.worker.platforms.base import Linear, Platform
from services.worker.platforms.cuda_fp8 import fp8_block_linear
from services.worker.platforms.moe_ops import MoeExperts, SortedExperts
from services.worker.quantization import Fp8BlockWeight, QuantizedWeight

log = logging.getLogger(__name__)

PAGE_SIZE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# What VarlenAttention passes beyond a plain varlen_attn (torch 2.11's has none of the first three).
PAGED_ARGUMENTS = ("block_table", "seqused_k", "enable_gqa", "window_size")


@dataclass(frozen=True)
class VarlenInputs:
    cu_seq_q: torch.Tensor  # [S + 1] int32: each sequence's first packed row, then T
    cu_seq_k: torch.Tensor  # [S + 1] int32: the same over the contexts
    seqused_k: torch.Tensor  # [S] int32: each context, new tokens included
    block_table: torch.Tensor  # [S, max_pages] int32
    max_q: int
    max_k: int


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


class VarlenAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 attend: Callable[..., torch.Tensor] | None = None):
        """`attend`: varlen_attn's signature; torch's own unless given."""
        if attend is None:
            from torch.nn.attention.varlen import varlen_attn as attend
        self._attend = attend
        self._num_kv_heads, self._head_dim, self._block_size = num_kv_heads, head_dim, block_size
        self._gqa = num_heads != num_kv_heads

    def prepare(self, sequences: StepSequences, device: torch.device) -> VarlenInputs:
        return VarlenInputs(
            cu_seq_q=_cumulative(sequences.num_new).to(device),
            cu_seq_k=_cumulative(sequences.context_lens).to(device),
            seqused_k=sequences.context_lens.to(device=device, dtype=torch.int32),
            block_table=sequences.block_tables.to(device=device, dtype=torch.int32),
            max_q=int(sequences.num_new.max()),
            max_k=int(sequences.context_lens.max()),
        )

    write_kv = staticmethod(write_kv_by_slot)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 inputs: VarlenInputs, block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        pages = (-1, self._block_size, self._num_kv_heads, self._head_dim)
        # (-1, 0) is causal; (W - 1, 0) keeps the W keys up to each query's own.
        window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
        return self._attend(
            query, key_cache.view(pages), value_cache.view(pages), inputs.cu_seq_q, inputs.cu_seq_k,
            inputs.max_q, inputs.max_k, scale=scale, window_size=window, enable_gqa=self._gqa,
            seqused_k=inputs.seqused_k, block_table=inputs.block_table,
        )


def missing_paged_arguments() -> list[str]:
    """What this torch's varlen_attn lacks of PAGED_ARGUMENTS (all of them where it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return list(PAGED_ARGUMENTS)
    parameters = inspect.signature(varlen_attn).parameters
    return [name for name in PAGED_ARGUMENTS if name not in parameters]


def pages_fit(block_size: int, dtype: torch.dtype) -> bool:
    """Whether flash attention's paged varlen path takes this pool (with this torch)."""
    return block_size % PAGE_SIZE_MULTIPLE == 0 and dtype in FLASH_DTYPES and not missing_paged_arguments()


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def available_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        """DeepSeek's FP8 blocks on the block-scaled FP8 GEMM where the device runs
        it (cuda_fp8.py); other quantized weights run dequantized."""
        if isinstance(weight, Fp8BlockWeight):
            fp8 = fp8_block_linear(weight, bias, self.device)
            if fp8 is not None:
                return fp8
        return super().linear(weight, bias)

    def paged_attention(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int) -> VarlenAttention | None:
        missing = missing_paged_arguments()
        if missing:
            log.warning("torch %s's varlen_attn has no %s: attention runs through SDPA over gathered K/V",
                        torch.__version__, ", ".join(missing))
            return None
        if not pages_fit(block_size, dtype):
            log.warning("flash attention pages %s pools by multiples of %d tokens; %s with %d-token blocks "
                        "attends through SDPA", FLASH_DTYPES, PAGE_SIZE_MULTIPLE, dtype, block_size)
            return None
        return VarlenAttention(num_heads, num_kv_heads, head_dim, block_size)

    def moe_experts(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                    num_experts: int | None = None) -> MoeExperts:
        """bfloat16 experts on torch's grouped GEMM where it runs (grouped_mm_fits),
        two calls per step whatever the number of experts with rows; otherwise
        the torch reference (one F.linear pair per expert with rows)."""
        if not (grouped_mm_fits(gate_up) and grouped_mm_fits(down)):
            return super().moe_experts(gate_up, down, first_expert, num_experts)
        return GroupedMmExperts(gate_up, down, first_expert, num_experts)


def grouped_mm():
    """torch's grouped GEMM: F.grouped_mm (torch 2.10 on), else torch._grouped_mm, else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_fits(weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these experts' weights [E, N, K]:
    bfloat16, N and K multiples of 8, on a CUDA device of compute capability
    8.0 or newer for F.grouped_mm (its documentation), 9.x where torch has
    only torch._grouped_mm (Hopper-only before torch 2.9; transformers' moe
    integration checks the same way)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cuda" or grouped_mm() is None:
        return False
    if weight.shape[1] % 8 or weight.shape[2] % 8:  # the kernel's operands: rows 16-byte aligned
        return False
    capability = torch.cuda.get_device_capability(weight.device)
    return capability >= (8, 0) if hasattr(torch.nn.functional, "grouped_mm") else capability[0] == 9


class GroupedMmExperts(SortedExperts):
    """The experts' GEMMs as two grouped GEMMs over the sorted rows, offsets on
    the device: no host sync. Never run on a GPU here (none in this
    repository's CI); torch 2.13 runs the same op on CPU tensors, which is how
    tests/unit/worker/test_moe.py checks the offsets and operand layouts."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int, num_experts: int | None):
        super().__init__(gate_up.shape[0], first_expert, num_experts)
        # mat_b [E, K, N]: the transposed views of [E, N, K], the column-major
        # operand the kernel wants (as transformers passes it).
        self._gate_up, self._down = gate_up.transpose(1, 2), down.transpose(1, 2)
        self._mm = grouped_mm()

    def run_sorted(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # each expert's end row
        gate, up = self._mm(x_sorted, self._gate_up, offs=offsets).chunk(2, dim=-1)
        # Rows past offsets[-1] (other shards') are left as the kernel leaves them;
        # moe_ops.combine counts them for nothing.
        return self._mm(F.silu(gate) * up, self._down, offs=offsets)
