"""CPU: the native kernels (cpu_kernels.py) where a C compiler built them,
oneDNN-prepacked linears otherwise (also per expert of a mixture-of-experts
layer where the grouped kernel is not built), and gloo for tensor parallelism."""
from __future__ import annotations

import functools
import logging
import os
from typing import ClassVar

import torch

from services.worker import cpu_kernels, int4, int8_kernels
from services.worker.attention import StepSequences, write_kv_by_slot
from services.worker.graphs import GraphBuffers
from services.worker.platforms.base import Linear, Platform, TorchLayerOps, host_available_memory, plain_linear
from services.worker.quantization import FourBitWeight, Int8Weight, QuantizedWeight, as_float
from services.worker.platforms.moe_ops import ANY_HEAD_DIM, LinearExperts, MoeExperts, SortedExperts, SortedRows

log = logging.getLogger(__name__)

# oneDNN and torch's ideep layer each keep every matmul primitive they build, one
# per input row count, about 0.7 MiB each: left at their default of 1,024,
# serving every step size from 1 to maxPrefillTokens + maxBatchSize rows would
# grow the worker by hundreds of MiB over time. 256 holds what a steady load
# reuses (at 32 streams no slower). Read at their first use; the operator's
# own setting wins.
for _cache in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "256")


def _add(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else y + residual


# The batch size oneDNN lays packed weights out for; measured on a 2-core AVX-512
# machine, packing for 32 rows serves 1 to 256 rows about as well as an exact hint.
_PACKING_ROWS = 32
# Up to this many rows, an exactly-4-bit weight runs on torch's int4 kernel
# (int4.py) beside oneDNN: whole decode steps of the bundled model measured 2.5
# times faster than bfloat16 at 1 row, 1.1 times at 8, and slower from about 10
# rows on.
_INT4_MAX_ROWS = 8
# On an AVX2 CPU, linear.c's 4-bit kernel beside its bfloat16 one (the bundled
# model's linears, 30 layers and lm_head, weights read from memory, Zen 3 VM):
# 11 against 19 ms at 1 row, 14 against 23 at 3, level at 4, slower from 5 rows
# on, where it moves from 4-row to 1-row tiles.
_Q4_MAX_ROWS = 4
# On an AVX512_BF16 CPU, linear.c's 4-bit kernel beside its bfloat16 one (the
# bundled model's layer shapes, 30 layers, weights read from memory, Zen 4 VM):
# 4.5 against 10.2 ms at 1 row, 7.0 against 11.2 at 8, 9.9 against 13.1 at 12,
# level at 16. Torch's int4 kernel: 4.9 ms at 1 row, 14.1 at 8.
_Q4_MAX_ROWS_AVX512 = 12
# With int8 activations (set_activations), int8.c's W4A8 kernel runs exactly-4-bit
# weights at every step size: the bundled model's linears (30 layers and lm_head,
# weights from memory, bench/int8_linear.py, 2-core Xeon with AVX512-VNNI) take
# 0.52, 0.53, 0.44 and 0.34 times the bfloat16 kernel's time at 1, 4, 8 and 32
# rows, and 0.88, 0.72, 0.49 and 0.33 times the 4-bit one's; the AVX2 build
# 0.32, 0.35, 0.38 and 0.48 times linear.c's AVX2 bfloat16 kernel. On a CPU with
# AMX (not measured here) oneDNN's bfloat16 tiles take steps of more rows than this.
_Q4A8_MAX_ROWS_AMX = 32
# On a CPU with AMX-INT8, W8A8 steps of this many rows or more run on oneDNN's int8
# GEMM (torch._int_mm), whose AMX tiles do eight times the int8 operations a cycle
# of AVX512-VNNI (Intel's figures); fewer rows stay on int8.c, bound by reading the
# weights. Not measured: no AMX machine was lent while this was written.
_INT8_AMX_MIN_ROWS = 64


@functools.cache
def cpu_computes_bfloat16() -> bool:
    """Whether oneDNN has native bfloat16 kernels on this CPU (AVX-512 BW/VL/DQ,
    AVX-512 BF16, AMX or AVX-NE-CONVERT). Without them bfloat16 matmuls are
    emulated: 3.4 times slower than float32 at 32 rows on a 2-core AVX2 EPYC, and
    the int4 kernel is 10 times slower than a float32 matmul there."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_activations_default() -> str:
    """What `auto` picks: int8 wherever int8.c's W4A8 kernel is built (AVX2,
    AVX-VNNI or AVX512-VNNI), which runs the 4-bit weights faster than bfloat16
    activations at every step size measured (see _Q4A8_MAX_ROWS_AMX) for a
    perplexity within 0.5 % of theirs on the bundled model (bench/quant_quality.py)."""
    return "int8" if int8_kernels.q4a8_linear_available() else "bfloat16"


class Int8MatmulLinear:
    """W8A8 on torch._int_mm, which runs oneDNN's int8 GEMM (AMX-INT8 tiles where
    the CPU has them): the activations quantized as int8.c does (per token, or
    with the static scale and offset), int32 sums, then the scales."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None):
        self._q_t = weight.q.t().contiguous()  # [in, out]
        self._scale = weight.scale.float()
        self._static = weight.static
        self._quant_bias = None if weight.static is None else weight.quant_bias(bias)
        self._bias = None if bias is None or weight.static is not None else bias.float()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape, rows = x.shape, x.reshape(-1, x.shape[-1]).float()
        if self._static is None:
            token_scale = rows.abs().amax(-1, keepdim=True) / 127
            xq = (rows / torch.where(token_scale > 0, token_scale, 1)).round().clamp(-127, 127)
            y = torch._int_mm(xq.to(torch.int8), self._q_t).float() * token_scale * self._scale
        else:
            input_scale, input_offset = self._static
            xq = (rows / input_scale + input_offset).round().clamp(-128, 127)
            y = (torch._int_mm(xq.to(torch.int8), self._q_t) + self._quant_bias).float() * self._scale
        if self._bias is not None:
            y = y + self._bias
        y = y.to(x.dtype).reshape(*shape[:-1], -1)
        return y if residual is None else y + residual


def _with_amx_int8(kernel: Linear, weight: Int8Weight, bias: torch.Tensor | None) -> Linear:
    """int8.c's kernel for steps of a few rows, oneDNN's AMX-INT8 GEMM for larger
    ones (_INT8_AMX_MIN_ROWS)."""
    matmul = Int8MatmulLinear(weight, bias)

    def linear(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return matmul(x, residual) if rows >= _INT8_AMX_MIN_ROWS else kernel(x, residual)

    return linear


class CpuAttention:
    """The native paged-attention kernel as an attention.AttentionKernel."""

    def __init__(self, kernel: cpu_kernels.PagedAttention):
        self._kernel = kernel

    def prepare(self, sequences: StepSequences, device: torch.device) -> StepSequences:
        return sequences

    def graph_inputs(self, buffers: GraphBuffers) -> GraphBuffers:
        """The buffers themselves, read as each call finds them: the CPU replays
        no graphs, but graphs.EagerCapture runs captured steps through here."""
        return buffers

    write_kv = staticmethod(write_kv_by_slot)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 inputs: StepSequences | GraphBuffers, block_size: int, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
        if isinstance(inputs, GraphBuffers):
            starts = inputs.query_start[:-1].long()
            inputs = StepSequences(inputs.block_table.long(), starts, torch.full_like(starts, inputs.rows_per_seq),
                                   inputs.seq_lens.long())
        return self._kernel(query, key_cache, value_cache, inputs.block_tables, inputs.starts, inputs.num_new,
                            inputs.context_lens, block_size, scale, sliding_window)


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    kv_memory_fraction: ClassVar[float] = 0.5

    # Whether exactly-4-bit weights run on int8 dot products (set_activations).
    int8_activations: bool = False

    def available_memory(self) -> int:
        return host_available_memory()

    def set_activations(self, activations: str) -> None:
        """`int8`: exactly-4-bit weights (Q4 GGUF, AWQ, GPTQ, W4A16) run on int8.c's
        W4A8 kernel, their activations quantized per row and group of 32 as
        llama.cpp does; `bfloat16`: on linear.c's 4-bit kernel with bfloat16
        activations; `auto`: int8 where the kernel is built (int8_activations_default)."""
        if activations == "int8" and not int8_kernels.q4a8_linear_available():
            raise ValueError("activations int8 needs int8.c's kernels: a C compiler and a CPU with AVX2 or VNNI")
        chosen = activations if activations != "auto" else int8_activations_default()
        self.int8_activations = chosen == "int8"
        log.info("activations of 4-bit weights: %s%s (int8 kernels on %s)", chosen,
                 " (auto)" if activations == "auto" else "", int8_kernels.int8_linear_isa() or "nothing: not built")

    def resolve_dtype(self, name: str) -> str:
        """`auto` is bfloat16 on CPUs that compute it natively or run the bfloat16
        linear kernel (cpu_kernels.py), float32 on other CPUs."""
        if name != "auto":
            return name
        if cpu_computes_bfloat16() or cpu_kernels.bfloat16_linear_available():
            return "bfloat16"
        return "float32"

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        """A bfloat16 weight runs on the bfloat16 linear kernel (cpu_kernels.py)
        where the CPU has AVX512_BF16 and no AMX, or AVX2 and no AVX-512; otherwise
        the weight is prepacked for oneDNN when it is float32, or bfloat16 on a CPU
        that computes bfloat16 natively (AMX where the CPU has it). Plain matmuls
        run 1.4 to 2.1 times slower at 1 to 32 rows: bfloat16 on an AVX-512 Xeon,
        float32 on an AVX2 EPYC (the bundled model's linears).
        A bfloat16 weight that is exactly 4-bit (from a Q4 GGUF) also gets a 4-bit
        kernel for steps of a few rows (_Q4_MAX_ROWS*, _INT4_MAX_ROWS): linear.c's
        where it is built (AVX512_BF16, or AVX2 without AVX-512, where torch's is 10
        times slower than a float32 matmul), else torch's int4 kernel on a CPU that
        computes bfloat16 natively. A 4-bit checkpoint's weight (quantization.FourBitWeight)
        brings its codes. An int8 weight whose format quantizes activations (W8A8,
        W8A8_DYNAMIC) runs on int8.c's integer dot products (cpu_kernels.py) as the
        format defines them; other quantized weights run dequantized.
        """
        if isinstance(weight, Int8Weight):
            static = weight.static is not None
            kernel = int8_kernels.packed_int8_linear(weight.q, weight.scale, None if static else bias, weight.static,
                                                    weight.quant_bias(bias) if static else None)
            if kernel is not None and cpu_kernels.cpu_has("amx_int8"):
                return _with_amx_int8(kernel, weight, bias)
            if kernel is not None:
                return kernel
        four_bit = None
        if isinstance(weight, FourBitWeight) and weight.codes.shape[0] % int4.N_MULTIPLE == 0:
            four_bit = weight.codes, weight.scale, weight.low
        weight = as_float(weight).detach()
        bias = None if bias is None else bias.detach()
        amx = torch.cpu._is_amx_tile_supported()
        if self.int8_activations and weight.dtype == torch.bfloat16 and not amx:
            # W4A8 for every step size: no bfloat16 copy of the weight is kept.
            four_bit = four_bit or int4.four_bit_codes(weight)
            w4a8 = None if four_bit is None else int8_kernels.packed_q4a8_linear(*four_bit, bias)
            if w4a8 is not None:
                return w4a8
        # With AMX, oneDNN's tile kernels outrun anything built on vdpbf16ps.
        packed_kernel = None if amx else cpu_kernels.packed_linear(weight, bias)
        prepacks = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_computes_bfloat16())
        if packed_kernel is not None:
            batched: Linear = packed_kernel
        elif prepacks and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS)

            def batched(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
                if residual is None:
                    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                # The residual add as the matmul's epilogue: no extra pass over the activations.
                return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
        else:
            return plain_linear(weight, bias)

        native = cpu_computes_bfloat16()
        exact_4bit = weight.dtype == torch.bfloat16 and (native or cpu_kernels.q4_linear_available())
        if not exact_4bit:
            return batched
        four_bit = four_bit or int4.four_bit_codes(weight)
        if four_bit is None:
            return batched
        small = int8_kernels.packed_q4a8_linear(*four_bit, bias) if self.int8_activations else None
        if small is not None:  # AMX: its bfloat16 tiles for larger steps
            int4_max_rows = _Q4A8_MAX_ROWS_AMX
        elif (small := cpu_kernels.packed_q4_linear(*four_bit, bias)) is not None:
            int4_max_rows = _Q4_MAX_ROWS_AVX512 if cpu_kernels.cpu_has("avx512_bf16") else _Q4_MAX_ROWS
        elif native:
            int4_max_rows = _INT4_MAX_ROWS
            torch_int4 = int4.pack_for_torch(*four_bit, weight.dtype)

            def small(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
                y = int4.int4_linear(x, *torch_int4)
                return _add(y if bias is None else y + bias, residual)
        else:
            return batched

        def small_batch_int4(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            return batched(x, residual) if x.shape[0] > int4_max_rows else small(x, residual)

        return small_batch_int4

    def layer_ops(self, dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int):
        """The one-pass kernels where they take `dtype` and these sizes."""
        return cpu_kernels.layer_ops(dtype, hidden_size, intermediate_size, head_dim) or TorchLayerOps()

    def paged_attention(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int) -> CpuAttention | None:
        kernel = cpu_kernels.paged_attention(dtype, num_heads, num_kv_heads, head_dim)
        return None if kernel is None else CpuAttention(kernel)

    def moe_experts(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                    num_experts: int | None = None) -> MoeExperts:
        """bfloat16 experts run on linear.c's grouped kernel where `linear` would
        take linear.c's: per step one call for every expert's gate_up, one
        SiLU-times-up, one call for every down, the experts without rows never
        read. Otherwise each expert with rows runs on this platform's linears."""
        hidden, intermediate = down.shape[1], down.shape[2]
        silu_mul = self.layer_ops(gate_up.dtype, hidden, intermediate, ANY_HEAD_DIM).silu_mul
        grouped = None if torch.cpu._is_amx_tile_supported() else cpu_kernels.packed_grouped_linear(gate_up)
        grouped_down = None if grouped is None else cpu_kernels.packed_grouped_linear(down)
        if grouped is not None and grouped_down is not None:
            return GroupedCpuExperts(grouped, grouped_down, silu_mul, first_expert, num_experts)
        return LinearExperts([self.linear(w, None) for w in gate_up], [self.linear(w, None) for w in down],
                             silu_mul, first_expert, num_experts)


class GroupedCpuExperts(SortedExperts):
    """The experts' GEMMs on cpu_kernels.GroupedLinear (moe_ops.SortedExperts sorts and combines)."""

    def __init__(self, gate_up: cpu_kernels.GroupedLinear, down: cpu_kernels.GroupedLinear, silu_mul,
                 first_expert: int, num_experts: int | None):
        super().__init__(gate_up.groups, first_expert, num_experts)
        self._gate_up, self._down, self._silu_mul = gate_up, down, silu_mul

    def run_sorted(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.zeros(self.num_local + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        # Rows past offsets[-1] (other shards') come out of both GEMMs as 0.
        return self._down(self._silu_mul(self._gate_up(x_sorted, offsets)), offsets)

    def combine(self, y_sorted: torch.Tensor, weights: torch.Tensor, rows: SortedRows,
                num_tokens: int) -> torch.Tensor:
        """kernels/moe.c's one pass, reading each pair's row where it sorted to."""
        positions = torch.arange(rows.order.numel())
        if rows.local is not None:  # another shard's pairs: skipped
            positions = torch.where(rows.local, positions, -1)
        where = torch.empty_like(positions).index_copy_(0, rows.order, positions)
        out = cpu_kernels.moe_combine(y_sorted, where, weights.reshape(-1).float(), num_tokens)
        return super().combine(y_sorted, weights, rows, num_tokens) if out is None else out
