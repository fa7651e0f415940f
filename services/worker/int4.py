"""Weights that are exactly 4-bit: groups of 32 input values that take at most 16
evenly spaced levels, as every Q4_0/Q4_1 GGUF tensor does after dequantizing.

Such a weight loses nothing when stored as 4-bit codes with a scale and zero
point per group, and an int4 kernel then streams a quarter of the bytes of
bfloat16: torch's on CPUs that compute bfloat16 natively, linear.c's on AVX2
CPUs (cpu_kernels.py). That wins at decode batch sizes, where a step is bound by
reading the weights; at larger batches the bfloat16 AMX path wins. Weights that
are not 4-bit (an HF bfloat16 checkpoint, a Q8_0 tensor) are left alone: this
is a faster way to run the same numbers, never a quantization.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32
LEVELS = 15  # codes 0..15
# How far a value may sit from its level, as a fraction of the level spacing: a
# 4-bit weight rounded to bfloat16 lands within about 0.04; anything else
# spreads up to 0.5.
_TOLERANCE = 0.1
# The kernel's tiling needs the output features in multiples of this.
N_MULTIPLE = 16


def four_bit_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [out, in] uint8 0..15, scale and low [out, in / 32] float32), with
    weight = codes * scale + low per group, or None when `weight` [out, in] is
    not exactly 4-bit in groups of 32 along `in`."""
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE or out_features % N_MULTIPLE:
        return None
    groups = weight.float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low = groups.amin(-1, keepdim=True)
    scale = (groups.amax(-1, keepdim=True) - low) / LEVELS
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - low) / safe_scale).round().clamp(0, LEVELS)
    error = (codes * scale + low - groups).abs()
    if bool((error > _TOLERANCE * safe_scale).any()):
        return None
    return codes.view(out_features, in_features).to(torch.uint8), scale[..., 0], low[..., 0]


def pack_for_torch(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales and zeros) for torch's int4 CPU kernel, from
    four_bit_codes; scales and zeros in `dtype`, the activations' dtype."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # The kernel computes (code - 8) * scale + zero.
    zero = low + 8 * scale
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ the 4-bit weight.T -> [rows, out]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales_and_zeros)
