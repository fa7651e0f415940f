"""The device-independent part of a platform: the interface every device
implements, and the plain-torch fallback of each operation.

A platform owns, for one device kind: device selection and synchronisation,
memory queries and the share of memory the KV pool may take, the dtype
`auto` means, the KV block sizes its attention kernel accepts, the paged
attention kernel (which also writes each step's K/V into the pool), the
linears, the fused RMSNorm / rotary / SiLU-times-up ops, the
mixture-of-experts router and experts (moe_ops.py), and the
torch.distributed backend of its tensor-parallel group. Model code
(decoder.py, attention.py) is device-agnostic torch and asks the platform.

The KV pool (kv_cache.py) is [num_layers, num_slots, kv_heads, head_dim] per
K and V, slot = block * block_size + offset: per layer, the same memory as
the (num_blocks, block_size, kv_heads, head_dim) layout that Ascend's
"Norm" cache mode and flash attention's paged KV read, so a kernel views it
without a copy.
"""
from __future__ import annotations

import os
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from services.worker.graphs import GraphCapture
from services.worker.quantization import QuantizedWeight, as_float
from services.worker.platforms.moe_ops import (ANY_HEAD_DIM, LinearExperts, MoeExperts, MoeRouting, TorchExperts,
                                               select_experts)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPES)}") from None


class Linear(Protocol):
    """x [..., in] -> x @ weight.T + bias [..., out], plus `residual` when given
    (fused into the matmul where the device can)."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor: ...


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    weight = weight.detach()
    bias = None if bias is None else bias.detach()

    def linear(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        return y if residual is None else y + residual

    return linear


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class TorchLayerOps:
    """RMSNorm, rotary embedding and SiLU-times-up in torch ops: on devices without
    fused kernels, and the reference the fused ones are tested against."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Accumulates in float32 and rounds once; HF rounds once more in bfloat16.
        return F.rms_norm(x, x.shape[-1:], weight, eps=eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, head_dim], cos and sin [rows, head_dim]; the rotated
        heads (a new tensor here; the CPU kernel rotates x in place)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class Platform:
    """One device kind. The defaults are plain torch: attention through
    attention.py's SDPA path, F.linear, TorchLayerOps."""

    name: ClassVar[str]
    # torch.distributed backend of a tensor-parallel group on this device.
    dist_backend: ClassVar[str]
    # The share of `available_memory` an automatic KV budget may take: an
    # accelerator's memory is the worker's (the reference uses 0.8 of NPU
    # memory); a CPU's is shared with the rest of the machine.
    kv_memory_fraction: ClassVar[float] = 0.8

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        """Wait for queued device work, so step timings measure the work itself."""

    def available_memory(self) -> int:
        """Bytes the KV pool may come out of now."""
        raise NotImplementedError

    def resolve_dtype(self, name: str) -> str:
        """`auto` is bfloat16 on accelerators; any other name is returned as it is."""
        return "bfloat16" if name == "auto" else name

    def set_activations(self, activations: str) -> None:
        """The worker's `activations` setting: int8 dot products for 4-bit weights
        are a CPU path; elsewhere `auto` and `bfloat16` run the activations in the
        run's dtype."""
        if activations == "int8":
            raise ValueError(f"activations int8 runs on CPU only, not {self.name}")

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        """y = x @ weight.T + bias, prepared once for this device. A quantized
        weight (quantization.py) runs dequantized where the platform has no
        kernel for it."""
        return plain_linear(as_float(weight, self.device), bias)

    def layer_ops(self, dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int) -> LayerOps:
        """This device's RMSNorm, rotary and SiLU-times-up for `dtype` and these sizes."""
        return TorchLayerOps()

    def paged_attention(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int):
        """This device's paged-attention kernel (attention.AttentionKernel) for a
        KV pool of `dtype`, this attention shape (the heads of this rank) and
        block size; None means attention.py's SDPA path, also where the kernel
        does not take this dtype or block size."""
        return None

    def moe_select(self, logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture-of-experts router's choice: logits [T, E] -> (weights [T, k]
        float32, ids [T, k]) (moe_ops.select_experts, the reference)."""
        return select_experts(logits, routing)

    def moe_experts(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                    num_experts: int | None = None) -> MoeExperts:
        """One layer's routed experts, prepared once: gate_up [E_local, 2I, H],
        down [E_local, H, I], the experts first_expert onwards of num_experts
        (default: all). The caller may drop its tensors after (moe_ops.py)."""
        return TorchExperts(gate_up, down, first_expert, num_experts)

    def quantized_moe_experts(self, gate_up: list[QuantizedWeight], down: list[QuantizedWeight],
                              first_expert: int = 0, num_experts: int | None = None) -> MoeExperts:
        """Routed experts a checkpoint quantized, one weight per local expert as it
        is stored: each expert with rows on this platform's linear for it (its
        integer or quantized-matmul kernels, see `linear`)."""
        hidden, intermediate = down[0].shape
        silu_mul = self.layer_ops(gate_up[0].dtype, hidden, intermediate, ANY_HEAD_DIM).silu_mul
        return LinearExperts([self.linear(w, None) for w in gate_up], [self.linear(w, None) for w in down], silu_mul,
                             first_expert, num_experts)

    def mla_ops(self, spec, num_heads: int):
        """This device's fused MLA ops (mla.MlaOps) over a latent pool of `spec`
        (kv_cache.KVCacheSpec) for `num_heads` query heads (this rank's); None
        means mla.py's torch ops."""
        return None

    def graph_capture(self) -> GraphCapture | None:
        """What captures this device's decode steps as graphs (graphs.py), its
        graphs sharing one memory pool; None, the default: no graphs on this
        device, every step runs eagerly."""
        return None

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device of the tensor-parallel group."""

    def set_num_threads(self, num_threads: int, num_ranks: int) -> None:
        """Give this rank its share of the worker's `num_threads` (0: the cores this
        process may use, usable_cpus), at least one: the ranks of a group on one
        host would otherwise each start a full thread team and wait on each other."""
        threads = max(1, (num_threads or min(torch.get_num_threads(), usable_cpus())) // num_ranks)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def usable_cpus() -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's
    CPU quota rounded down (a container's CPU limit; torch counts the host's
    cores, and a thread team larger than the quota stalls whenever the quota
    runs out mid-step)."""
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time per period the cgroup allows (cgroup v2's cpu.max,
    else v1's cfs quota and period); None where unlimited or unreadable."""
    for quota_file, period_file in ((f"{root}/cpu.max", None),
                                    (f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as file:
                fields = file.read().split()
            if period_file is not None:
                with open(period_file) as file:
                    fields.append(file.read().strip())
        except OSError:
            continue
        quota, period = fields[0], fields[1]
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    return None


def host_available_memory() -> int:
    """What Linux reports available (MemAvailable)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
