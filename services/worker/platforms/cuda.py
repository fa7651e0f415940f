"""CUDA without vLLM: paged attention and the KV write as Triton kernels.

Attention reads K/V in place through the block tables, one launch for the
whole packed step (prefill chunks, chunks over a cached prefix, decodes and
drafted rows mixed), and reads its lengths from device tensors only, so a
decode step can be captured in a CUDA graph (triton_attention.py).
TritonAttention takes float16, bfloat16 and float32 pools with blocks of a
multiple of 16 tokens and any head_dim; other pools, or a machine without
Triton, attend through attention.py's SDPA path over gathered K/V, which is
also the oracle the kernel is tested against (on CPU through Triton's
interpreter: tests/unit/worker/test_triton_attention.py; on a GPU:
tests/gpu/test_cuda.py).

Mixture-of-experts layers run their experts on torch's grouped GEMM
(F.grouped_mm / torch._grouped_mm, bfloat16, sm80+ / sm90) where it exists.
DeepSeek's FP8 blocks run on the block-scaled FP8 GEMM (cuda_fp8.py). None
of this file has run on a GPU in this repository's tests: the Triton kernels
run there through the interpreter, and are compiled for sm_80 and sm_90.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from services.worker.platforms.base import Linear, Platform
from services.worker.platforms.cuda_fp8 import fp8_block_linear
from services.worker.platforms.cuda_graphs import CudaGraphCapture
from services.worker.platforms.moe_ops import MoeExperts, SortedExperts
from services.worker.quantization import Fp8BlockWeight, QuantizedWeight

if TYPE_CHECKING:
    from services.worker.platforms.triton_attention import TritonAttention

log = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    dist_backend: ClassVar[str] = "nccl"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def available_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def graph_capture(self) -> CudaGraphCapture:
        return CudaGraphCapture(self.device)

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
                        block_size: int) -> TritonAttention | None:
        """TritonAttention where it takes the pool; None (SDPA over gathered K/V) otherwise."""
        try:
            from services.worker.platforms.triton_attention import TritonAttention, triton_fits
        except ImportError as exc:
            log.warning("no Triton (%s): attention runs through SDPA over gathered K/V", exc)
            return None
        if not triton_fits(dtype, block_size, head_dim):
            log.warning("the Triton attention takes float16, bfloat16 and float32 pools in blocks of a multiple "
                        "of 16 tokens; %s with %d-token blocks attends through SDPA", dtype, block_size)
            return None
        return TritonAttention(num_heads, num_kv_heads, head_dim, block_size)

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
