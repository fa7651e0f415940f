"""The device seam: which accelerator the worker runs on, and the few calls
that differ between them. Nothing else in the worker names cuda or npu.

The pure-torch paged attention path (attention.py) runs on every device: plain
torch + SDPA. On CPU, attention runs on a native kernel instead (cpu_kernels.py)
where a C compiler is there to build it. Fused Ascend / CUDA paged kernels
would plug in the same way (`paged_attention`). CPU is the only
device exercised in this repo's tests.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker import cpu_kernels, int4

log = logging.getLogger(__name__)

# oneDNN and torch's ideep layer each keep every matmul primitive they build, one
# per input row count, about 0.7 MiB each: left at their default of 1,024,
# serving every step size from 1 to maxPrefillTokens + maxBatchSize rows would
# grow the worker by hundreds of MiB over time. 256 holds what a steady load
# reuses (at 32 streams no slower). Read at their first use; the operator's
# own setting wins.
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "256")

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class Linear(Protocol):
    """x [..., in] -> x @ weight.T + bias [..., out], plus `residual` when given
    (fused into the matmul where the device can)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...


def _add(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else y + residual

# The batch size oneDNN lays packed weights out for; measured on a 2-core AVX-512
# machine, packing for 32 rows serves 1 to 256 rows about as well as an exact hint.
_PACKING_ROWS = 32
# Up to this many rows, an exactly-4-bit weight runs on the int4 kernel (int4.py).
# Beside oneDNN: whole decode steps of the bundled model measured 2.5 times
# faster than bfloat16 at 1 row, 1.1 times at 8, and slower from about 10 rows
# on. Beside the vdpbf16ps kernel (the bundled model's linears, 30 layers): 2.0
# times faster at 1 row, 1.26 at 4, and 1.4 times slower from 5 rows on, where
# the int4 kernel moves from 4-row to 1-row tiles.
_INT4_MAX_ROWS = 8
_INT4_MAX_ROWS_BESIDE_KERNEL = 4
# On an AVX2 CPU, linear.c's 4-bit kernel beside its bfloat16 one (the bundled
# model's linears, 30 layers and lm_head, weights read from memory, Zen 3 VM):
# 11 against 19 ms at 1 row, 14 against 23 at 3, level at 4, slower from 5 rows
# on, where it moves from 4-row to 1-row tiles.
_Q4_MAX_ROWS = 4


def _npu_available() -> bool:
    # torch_npu registers the "npu" device on import; it only exists on Ascend hosts.
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


@functools.cache
def cpu_computes_bfloat16() -> bool:
    """Whether oneDNN has native bfloat16 kernels on this CPU (AVX-512 BW/VL/DQ,
    AVX-512 BF16, AMX or AVX-NE-CONVERT). Without them bfloat16 matmuls are
    emulated: 3.4 times slower than float32 at 32 rows on a 2-core AVX2 EPYC, and
    the int4 kernel is 10 times slower than a float32 matmul there."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class Backend:
    """The chosen device and its device-specific operations."""

    name: str  # cpu, cuda or npu
    device: torch.device

    def synchronize(self) -> None:
        """Wait for queued device work, so step timings measure the work itself."""
        if self.name == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.name == "npu":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def available_memory(self) -> int:
        """Bytes the KV pool may come out of now: free device memory, or on CPU
        what Linux reports available (MemAvailable)."""
        if self.name == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        if self.name == "npu":
            return torch.npu.mem_get_info(self.device)[0]  # type: ignore[attr-defined]
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    @property
    def kv_memory_fraction(self) -> float:
        """The share of `available_memory` an automatic KV budget may take: an
        accelerator's memory is the worker's (the reference uses 0.8 of NPU
        memory); a CPU's is shared with the rest of the machine."""
        return 0.5 if self.name == "cpu" else 0.8

    def resolve_dtype(self, name: str) -> str:
        """`auto` is bfloat16 on accelerators and on CPUs that compute it natively
        or run the bfloat16 linear kernel (cpu_kernels.py), float32 on other CPUs;
        any other name is returned as it is."""
        if name != "auto":
            return name
        if self.name != "cpu" or cpu_computes_bfloat16() or cpu_kernels.bfloat16_linear_available():
            return "bfloat16"
        return "float32"

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """y = x @ weight.T + bias, prepared once for this device.

        On CPU a bfloat16 weight runs on the bfloat16 linear kernel (cpu_kernels.py)
        where the CPU has AVX512_BF16 and no AMX, or AVX2 and no AVX-512; otherwise
        the weight is prepacked for oneDNN when it is float32, or bfloat16 on a CPU
        that computes bfloat16 natively (AMX where the CPU has it). Plain matmuls
        run 1.4 to 2.1 times slower at 1 to 32 rows: bfloat16 on an AVX-512 Xeon,
        float32 on an AVX2 EPYC (the bundled model's linears).
        A bfloat16 weight that is exactly 4-bit (from a Q4 GGUF) also gets a 4-bit
        kernel for steps of a few rows (_INT4_MAX_ROWS*, _Q4_MAX_ROWS): torch's
        int4 kernel on a CPU that computes bfloat16 natively, linear.c's on an
        AVX2 CPU, where torch's is 10 times slower than a float32 matmul.
        """
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        if self.name != "cpu":
            return lambda x, residual=None: _add(F.linear(x, weight, bias), residual)
        # With AMX, oneDNN's tile kernels outrun anything built on vdpbf16ps.
        packed_kernel = None if torch.cpu._is_amx_tile_supported() else cpu_kernels.packed_linear(weight, bias)
        prepacks = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_computes_bfloat16())
        if packed_kernel is not None:
            batched: Linear = packed_kernel
            int4_max_rows = _INT4_MAX_ROWS_BESIDE_KERNEL
        elif prepacks and torch.backends.mkldnn.is_available():
            int4_max_rows = _INT4_MAX_ROWS
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS)

            def batched(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
                if residual is None:
                    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                # The residual add as the matmul's epilogue: no extra pass over the activations.
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
        else:
            return lambda x, residual=None: _add(F.linear(x, weight, bias), residual)

        native = cpu_computes_bfloat16()
        exact_4bit = weight.dtype == torch.bfloat16 and (native or cpu_kernels.q4_linear_available())
        four_bit = int4.four_bit_codes(weight) if exact_4bit else None
        if four_bit is None:
            return batched
        if native:
            torch_int4 = int4.pack_for_torch(*four_bit, weight.dtype)

            def small(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
                y = int4.int4_linear(x, *torch_int4)
                return _add(y if bias is None else y + bias, residual)
        else:
            small = cpu_kernels.packed_q4_linear(*four_bit, bias)
            int4_max_rows = _Q4_MAX_ROWS
            if small is None:
                return batched

        def small_batch_int4(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            return batched(x, residual) if x.shape[0] > int4_max_rows else small(x, residual)

        return small_batch_int4

    def paged_attention(
        self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> cpu_kernels.PagedAttention | None:
        """This device's paged-attention kernel for a KV pool of `dtype` and this
        attention shape; None means attention.py's SDPA path."""
        if self.name != "cpu":
            return None
        return cpu_kernels.paged_attention(dtype, num_heads, num_kv_heads, head_dim)

    def layer_ops(
        self, dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int
    ) -> cpu_kernels.LayerOps | None:
        """This device's one-pass RMSNorm, rotary and SiLU-times-up for `dtype` and
        these sizes; None means decoder.py's torch ops."""
        if self.name != "cpu":
            return None
        return cpu_kernels.layer_ops(dtype, hidden_size, intermediate_size, head_dim)

    def set_num_threads(self, num_threads: int) -> None:
        if num_threads > 0:
            torch.set_num_threads(num_threads)


def select_backend(requested: str) -> Backend:
    """`auto` prefers cuda, then npu, then cpu; an explicit device must exist."""
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif _npu_available():
            requested = "npu"
        else:
            requested = "cpu"
    elif requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available")
    elif requested == "npu" and not _npu_available():
        raise RuntimeError("device=npu requested but torch_npu / an Ascend NPU is not available")
    if requested not in ("cpu", "cuda", "npu"):
        raise ValueError(f"unknown device {requested!r}")
    backend = Backend(name=requested, device=torch.device(requested))
    log.info("device %s", backend.device)
    return backend


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPES)}") from None
