"""The CUDA platform's block-scaled FP8 linear (platforms/cuda_fp8.py), on CPU:
torch has no block-scaled recipe here, so the fallback is checked as it is, and
the plumbing (per-token-group activation quantization, the scales' layout
probe, bias and residual) through a reference of F.scaled_mm's BlockWise1x128
× BlockWise128x128 semantics that takes column-major scales only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.platforms import cuda_fp8
from services.worker.platforms.cuda import CudaPlatform
from services.worker.quantization import Fp8BlockWeight

CPU = torch.device("cpu")


def _weight(out_features: int = 256, in_features: int = 384) -> Fp8BlockWeight:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.1).to(torch.float8_e4m3fn)
    scale = torch.rand(out_features // 128, in_features // 128, generator=generator) + 0.5
    return Fp8BlockWeight(weight, scale, (128, 128), torch.bfloat16)


def _reference_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    if scale_a.stride(0) != 1 or scale_b.stride(0) != 1:
        raise RuntimeError("scales must be column-major")
    (m, k), n = mat_a.shape, mat_b.shape[1]
    assert scale_a.shape == (m, k // 128) and scale_b.shape == (n // 128, k // 128)
    a = mat_a.float() * scale_a.repeat_interleave(128, 1)
    b = mat_b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1).t()
    return (a @ b).to(output_dtype)


@pytest.fixture
def fresh_probe():
    cuda_fp8.scale_layout.cache_clear()
    yield
    cuda_fp8.scale_layout.cache_clear()


def test_without_the_recipe_fp8_weights_run_dequantized(fresh_probe):
    weight = _weight()
    assert cuda_fp8.fp8_block_linear(weight, None, CPU) is None  # CPU torch has no block-scaled recipe
    linear = CudaPlatform(CPU).linear(weight, None)
    x = torch.randn(3, 384).to(torch.bfloat16)
    torch.testing.assert_close(linear(x), x @ weight.dequantize().to(torch.bfloat16).t())


def test_the_block_scaled_linear_quantizes_per_token_group(fresh_probe, monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", _reference_scaled_mm)
    weight = _weight()
    bias = torch.randn(256)
    linear = CudaPlatform(CPU).linear(weight, bias)
    assert isinstance(linear, cuda_fp8.Fp8BlockLinear)
    assert cuda_fp8.scale_layout(CPU, torch.bfloat16) == "column-major"  # the layout the op took
    x = (torch.randn(5, 384) * torch.tensor([0.01, 1, 100, 1, 1])[:, None]).to(torch.bfloat16)
    residual = torch.randn(5, 256).to(torch.bfloat16)
    expected = x.float() @ weight.dequantize().t() + bias + residual.float()
    y = linear(x, residual).float()
    assert ((y - expected).norm(dim=1) / expected.norm(dim=1)).max() < 0.05  # FP8 activations: 3 mantissa bits


def test_weights_the_recipe_does_not_take_are_left_to_dequantization(fresh_probe, monkeypatch):
    monkeypatch.setattr(F, "scaled_mm", _reference_scaled_mm)
    partial = Fp8BlockWeight(torch.zeros(200, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 3), (128, 128),
                             torch.bfloat16)
    assert cuda_fp8.fp8_block_linear(partial, None, CPU) is None
    float32 = Fp8BlockWeight(_weight().weight, _weight().scale, (128, 128), torch.float32)
    assert cuda_fp8.fp8_block_linear(float32, None, CPU) is None
