"""Integer dot-product linears (kernels/int8.c), built into the same library as
the other CPU kernels (cpu_kernels.py): activations quantized to int8 per call
and int32 sums on `vpdpbusd` (AVX512-VNNI, AVX-VNNI) or `vpmaddubsw` /
`vpmaddwd` (AVX2).

- W8A8 (packed_int8_linear): int8 weights with a scale per output row, the
  activations per token or with a static scale and offset, as msModelSlim's
  W8A8 / W8A8_DYNAMIC define them.
- W4A8 (packed_q4a8_linear): exactly-4-bit weights (int4.four_bit_codes), the
  activations per row and group of 32 inputs, as llama.cpp's Q8_0.

The integer sums are exact; `library` arguments take another build
(cpu_kernels.load_library with extra flags: the AVX2 and AVX-VNNI builds the
tests and bench/int8_linear.py run on wider CPUs).
"""
from __future__ import annotations

import ctypes

import torch

from services.worker.cpu_kernels import this_library


class QuantizedLinear:
    """y = x @ W.T + bias (+ residual) for bfloat16 or float32 x [..., in], on
    one of int8.c's kernels (the activations quantised to int8 per call, the
    weight packed once for it); y in x's dtype."""

    def __init__(self, function, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None, *extra):
        self._function = function
        self._packed = packed
        self._out_features, self._in_features = out_features, in_features
        self._bias = None if bias is None else bias.detach().float().contiguous()
        self._extra = extra  # trailing arguments (W8A8: its static input quantisation, or None), kept alive
        self._extra_args = tuple(None if t is None else t.data_ptr() for t in extra)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32) or (residual is not None and residual.dtype != x.dtype):
            raise TypeError(f"the int8 linear kernels take bfloat16 or float32 activations and a residual of "
                            f"the same dtype, got {x.dtype}" + ("" if residual is None else f" and {residual.dtype}"))
        shape = (*x.shape[:-1], self._out_features)
        # The kernel reads whole rows of in_features: other shapes would read past x or residual.
        if x.shape[-1] != self._in_features or (residual is not None and residual.shape != shape):
            raise ValueError(f"the linear maps [..., {self._in_features}] to {shape}, got {tuple(x.shape)}"
                             + ("" if residual is None else f" and a {tuple(residual.shape)} residual"))
        out = torch.empty(shape, dtype=x.dtype)
        rows = x.numel() // self._in_features
        if rows == 0:
            return out
        x = x.contiguous()
        if residual is not None:
            residual = residual.contiguous()
        status = self._function(
            x.data_ptr(), self._packed.data_ptr(), None if self._bias is None else self._bias.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(),
            rows, self._out_features, self._in_features, int(x.dtype == torch.bfloat16), *self._extra_args,
        )
        if status != 0:
            raise MemoryError("int8 linear kernel: out of memory for the quantised activations")
        return out


def int8_linear_available(library: ctypes.CDLL | None = None) -> bool:
    """Whether this CPU (or `library`, a build from load_library) runs int8.c's
    W8A8 and W4A8 linears: AVX512_VNNI, AVX-VNNI or AVX2."""
    library = library if library is not None else this_library()
    return library is not None and hasattr(library, "linear_w8a8")


def int8_linear_isa(library: ctypes.CDLL | None = None) -> str | None:
    """The instructions int8.c's kernels were built on ("avx512_vnni", "avx_vnni"
    or "avx2", as /proc/cpuinfo names them), or None where they are not built."""
    library = library if library is not None else this_library()
    if not int8_linear_available(library):
        return None
    return {3: "avx512_vnni", 2: "avx_vnni", 1: "avx2"}[library.int8_isa()]


def q4a8_linear_available(library: ctypes.CDLL | None = None) -> bool:
    """Whether packed_q4a8_linear has a kernel (built beside the W8A8 one)."""
    return int8_linear_available(library)


def packed_int8_linear(weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       static: tuple[float, float] | None = None, quant_bias: torch.Tensor | None = None, *,
                       library: ctypes.CDLL | None = None) -> QuantizedLinear | None:
    """int8.c's W8A8 kernel for int8 `weight` [out, in] with a float `weight_scale`
    per output [out], or None where there is none: not int8, out not a multiple
    of 16 or in of 32 (or over 65536), or no kernel built (int8_linear_available).

    static None (dynamic): per row s = max |x| / 127, xq = round(x / s) in
    [-127, 127], y = s * weight_scale * (xq @ weight.T + quant_bias) + bias.
    static (input_scale, input_offset), msModelSlim's W8A8: xq = round(x /
    input_scale + input_offset) in [-128, 127], y = weight_scale * (xq @ weight.T
    + quant_bias) (+ bias, which msModelSlim folds into quant_bias, int32 [out]).
    The integer sums are exact; `library` as in packed_linear."""
    out_features, in_features = weight.shape
    library = library if library is not None else this_library()
    if weight.dtype != torch.int8 or not int8_linear_available(library):
        return None
    # One value per output, as [out] or [out, 1]; an integer scale would be a misread (not a conversion).
    if weight_scale.numel() != out_features or not weight_scale.is_floating_point():
        raise ValueError(f"weight_scale must be {out_features} floats, got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    if quant_bias is not None and (quant_bias.numel() != out_features or quant_bias.dtype != torch.int32):
        raise ValueError(f"quant_bias must be {out_features} int32, got {quant_bias.dtype} {tuple(quant_bias.shape)}")
    size = library.w8a8_packed_bytes(out_features, in_features)
    if size < 0:  # a shape the layout does not take
        return None
    weight = weight.detach().contiguous()
    scale = weight_scale.detach().float().reshape(-1).contiguous()
    quant_bias = None if quant_bias is None else quant_bias.detach().reshape(-1).contiguous()
    packed = torch.empty(size, dtype=torch.uint8)
    library.pack_linear_w8a8(weight.data_ptr(), scale.data_ptr(), None if quant_bias is None else quant_bias.data_ptr(),
                             out_features, in_features, packed.data_ptr())
    input_quant = None if static is None else torch.tensor([float(static[0]), float(static[1])], dtype=torch.float32)
    return QuantizedLinear(library.linear_w8a8, packed, out_features, in_features, bias, input_quant)


def packed_q4a8_linear(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None, *,
                       library: ctypes.CDLL | None = None) -> QuantizedLinear | None:
    """int8.c's W4A8 kernel for the weight of packed_q4_linear (codes [out, in]
    0..15, scale and low [out, in / 32]: code * scale + low per group of 32
    inputs), or None where there is none: out not a multiple of 16 or in of 32,
    or no kernel built. The activations are quantised per row and group of 32
    (as llama.cpp's Q8_0): s = max |x| / 127, xq = round(x / s); y = sum over
    groups of s * (scale * codes . xq + low * sum(xq)) + bias. `library` as in
    packed_linear."""
    out_features, in_features = codes.shape
    library = library if library is not None else this_library()
    if not q4a8_linear_available(library):
        return None
    size = library.q4a8_packed_bytes(out_features, in_features)
    groups = (out_features, in_features // 32)
    if size < 0 or scale.shape != groups or low.shape != groups:
        return None
    codes = codes.detach().to(torch.uint8).contiguous()
    scale, low = scale.detach().float().contiguous(), low.detach().float().contiguous()
    packed = torch.empty(size, dtype=torch.uint8)
    library.pack_linear_q4a8(codes.data_ptr(), scale.data_ptr(), low.data_ptr(), out_features, in_features,
                             packed.data_ptr())
    return QuantizedLinear(library.linear_q4a8, packed, out_features, in_features, bias)
