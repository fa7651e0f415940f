"""DeepSeek's FP8 blocks on CUDA's block-scaled FP8 GEMM, as vLLM runs them on
Hopper (w8a8_block_fp8_matmul): the activations quantized to float8_e4m3fn per
token and group of 128 inputs (scale = max |x| / 448), the weight as stored
with a scale per 128 × 128 block, through torch's F.scaled_mm with the
BlockWise1x128 and BlockWise128x128 recipes (torch 2.9 and later, sm90+).

Which layout a torch release takes for the scales, and whether the device runs
the recipe at all, is settled once per process by a probe against the
dequantized product; where neither layout matches, or the op raises, the
weights run dequantized (bfloat16), and the log says so. Never run on a GPU
here: on CPU torch has no block-scaled recipe, and tests drive the plumbing
through a reference of the op's semantics."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from services.worker.quantization import Fp8BlockWeight

log = logging.getLogger(__name__)

BLOCK = 128
FP8_MAX = 448.0
# The probe's tolerance: FP8 activations (3 mantissa bits) against float ones.
_PROBE_RELATIVE_ERROR = 0.1


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (float8_e4m3fn [m, k], float32 scales [m, k / 128])."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (groups / scale[..., None]).to(torch.float8_e4m3fn).view(m, k), scale


def _layouts(scale: torch.Tensor):
    """The scale as given, and column-major (the outer dimension contiguous)."""
    return {"row-major": scale.contiguous(), "column-major": scale.t().contiguous().t()}


def _matmul(xq, x_scale, weight, weight_scale, dtype, layout: str) -> torch.Tensor:
    return F.scaled_mm(xq, weight.t(), _layouts(x_scale)[layout], F.ScalingType.BlockWise1x128,
                       _layouts(weight_scale)[layout], F.ScalingType.BlockWise128x128, output_dtype=dtype)


@functools.cache
def scale_layout(device: torch.device, dtype: torch.dtype) -> str | None:
    """The scale layout this torch and device take for block-scaled FP8, checked
    against the dequantized product on random data, or None where none works."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 256, generator=generator) * 0.05).to(torch.float8_e4m3fn).to(device)
    weight_scale = (torch.rand(2, 2, generator=generator) + 0.5).to(device)
    x = torch.randn(16, 256, generator=generator).to(device=device, dtype=dtype)
    expected = x.float() @ Fp8BlockWeight(weight.cpu(), weight_scale.cpu(), (BLOCK, BLOCK)).dequantize().to(device).t()
    xq, x_scale = quantize_groups(x)
    for layout in ("column-major", "row-major"):
        try:
            y = _matmul(xq, x_scale, weight, weight_scale, dtype, layout).float()
        except (RuntimeError, ValueError, AttributeError, NotImplementedError) as exc:
            log.info("block-scaled FP8 with %s scales: %s", layout, str(exc).splitlines()[0][:200])
            continue
        error = float((y - expected).norm() / expected.norm())
        if error < _PROBE_RELATIVE_ERROR:
            return layout
        log.info("block-scaled FP8 with %s scales is off by %.2f of the product", layout, error)
    log.warning("torch %s has no block-scaled FP8 GEMM on %s: FP8 weights run dequantized", torch.__version__, device)
    return None


class Fp8BlockLinear:
    def __init__(self, weight: Fp8BlockWeight, bias: torch.Tensor | None, device: torch.device, layout: str):
        self._weight = weight.weight.to(device)
        self._scale = weight.scale.float().to(device)
        self._bias = None if bias is None else bias.to(device=device, dtype=weight.dtype)
        self._dtype, self._layout = weight.dtype, layout

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        xq, x_scale = quantize_groups(x.reshape(-1, shape[-1]))
        y = _matmul(xq, x_scale, self._weight, self._scale, self._dtype, self._layout).reshape(*shape[:-1], -1)
        if self._bias is not None:
            y = y + self._bias
        return y if residual is None else y + residual


def fp8_block_linear(weight: Fp8BlockWeight, bias: torch.Tensor | None, device: torch.device) -> Fp8BlockLinear | None:
    """The block-scaled FP8 linear, or None where it does not take the weight
    (blocks other than 128 × 128, partial blocks, float32 runs) or the device
    has no such GEMM."""
    out_features, in_features = weight.weight.shape
    if weight.block != (BLOCK, BLOCK) or out_features % BLOCK or in_features % BLOCK:
        return None
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    layout = scale_layout(device, weight.dtype)
    return None if layout is None else Fp8BlockLinear(weight, bias, device, layout)
