"""int8.c's W8A8 and W4A8 linears against the same quantised math in torch, on
every build this CPU runs: AVX512_VNNI (native), AVX-VNNI (-mno-avx512f) and
AVX2 (neither). Integer sums are exact, so a kernel is off from the reference
only by float32 rounding of its scaling and adds; one activation quantised a
step off, or one saturated sum, is far outside that."""
from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from services.worker import cpu_kernels, int8_kernels

KERNELS = cpu_kernels._KERNELS
# Build: (flags after -march=native, the CPU flags it needs).
VARIANTS = {
    "avx512_vnni": ((), ("avx512_vnni", "avx512bw")),
    "avx_vnni": (("-mno-avx512f",), ("avx_vnni", "avx2", "fma")),
    "avx2": (("-mno-avx512f", "-mno-avxvnni"), ("avx2", "fma")),
}
ROWS = [1, 3, 17, 64, 300]
# Whole and partial tiles and strips: 1, 5 and 13 column blocks of 16.
SHAPES = [(16, 64), (80, 96), (208, 32)]


@functools.cache
def _build(variant: str):
    return cpu_kernels.load_library(KERNELS, VARIANTS[variant][0])


def library(variant: str):
    flags, needs = VARIANTS[variant]
    if shutil.which("cc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler")
    missing = [flag for flag in needs if not cpu_kernels.cpu_has(flag)]
    if missing:
        pytest.skip(f"this CPU lacks {' '.join(missing)}")
    built = _build(variant)
    if built is None or not int8_kernels.int8_linear_available(built):
        pytest.skip(f"the compiler does not build the {variant} kernels ({' '.join(flags)})")
    return built


def _close(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, bound: float) -> None:
    """got within `bound` times the magnitude of the terms each output sums."""
    error = (got.double() - expected).abs()
    worst = (error / (magnitude * bound + 1e-30)).max()
    assert worst <= 1, f"off by {float(error.max()):.3g}, {float(worst):.3g} times the float32 rounding bound"


def _w8a8_reference(x, weight, weight_scale, static, quant_bias):
    """(y without bias and residual, the magnitude of its terms) in float64, the
    activations quantised in float32 as the kernel does."""
    x = x.float()
    if static is None:
        amax = x.abs().amax(-1, keepdim=True)
        row_scale = amax / 127
        xq = torch.round(x / torch.where(amax > 0, row_scale, torch.ones_like(row_scale))).clamp(-127, 127)
    else:
        row_scale = torch.ones(x.shape[0], 1)
        xq = torch.round(x / static[0] + static[1]).clamp(-128, 127)
    sums = xq.double() @ weight.double().T
    if quant_bias is not None:
        sums = sums + quant_bias.double()
    scale = (row_scale * weight_scale.float()).double()  # rounded to float32 as the kernel's
    return scale * sums, (scale * sums).abs()


def _check(linear, x, bias, residual, expected, magnitude):
    """float32 x: within float32 rounding of the reference, without and with
    bias and residual; bfloat16 x: the float32 result rounded once."""
    bias64 = 0 if bias is None else bias.double()
    magnitude = magnitude + (0 if bias is None else bias.double().abs())
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    _close(got, expected + bias64, magnitude, 2.0 ** -20)
    got = linear(x, residual)
    _close(got, expected + bias64 + residual.double(), magnitude + residual.double().abs(), 2.0 ** -20)
    # bfloat16 in and out: quantised from the same values, one rounding of the same float32 sum.
    x16, residual16 = x.bfloat16(), residual.bfloat16()
    exact = linear(x16.float(), residual16.float())
    got = linear(x16, residual16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, exact.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_w8a8_matches_the_quantised_math(variant: str, rows: int, mode: str):
    lib = library(variant)
    for n, k in SHAPES:
        generator = torch.Generator().manual_seed(rows * n + k)
        weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
        weight_scale = torch.rand(n, generator=generator) * 0.01 + 1e-3
        x = torch.randn(rows, k, generator=generator) * 3
        x[0, : k // 2] = 0  # a row's half of zeros; below, a row of them (scale 0)
        if rows > 2:
            x[2] = 0
        residual = torch.randn(rows, n, generator=generator)
        if mode == "dynamic":
            static, quant_bias, bias = None, None, torch.randn(n, generator=generator)
        else:  # msModelSlim: the bias folded into an int32 quant_bias; values past the int8 range clamp
            static, bias = (0.02, 3.0), None
            quant_bias = torch.randint(-5000, 5000, (n,), dtype=torch.int32, generator=generator)
        linear = int8_kernels.packed_int8_linear(weight, weight_scale, bias, static, quant_bias, library=lib)
        assert linear is not None
        expected, magnitude = _w8a8_reference(x, weight, weight_scale, static, quant_bias)
        _check(linear, x, bias, residual, expected, magnitude)


@pytest.mark.parametrize("variant", VARIANTS)
def test_w8a8_sums_at_the_ends_of_the_int8_range_are_exact(variant: str):
    """Pairs of products of -128 and 255 (xq + 128) overflow int16, where
    vpmaddubsw saturates: every sum here is exact, and exactly representable."""
    lib = library(variant)
    k = 256
    weight = torch.full((32, k), -128, dtype=torch.int8)
    weight[16:, 1::2] = 127
    ones = torch.ones(32)
    x = torch.full((3, k), -128.0)  # static scale 1, offset 0: xq = x
    x[1], x[2, ::2] = 127.0, 127.0
    linear = int8_kernels.packed_int8_linear(weight, ones, None, (1.0, 0.0), library=lib)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(linear(x).double(), expected, rtol=0, atol=0)
    # Dynamic: the rows quantise to +-127 (scale 128 / 127 for the first).
    linear = int8_kernels.packed_int8_linear(weight, ones, None, library=lib)
    expected, _ = _w8a8_reference(x, weight, ones, None, None)
    torch.testing.assert_close(linear(x).double(), expected, rtol=2.0 ** -23, atol=0)


def _q4a8_reference(x, codes, scale, low):
    rows, k = x.shape
    n = codes.shape[0]
    groups = x.float().view(rows, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    block_scale = amax / 127
    xq = torch.round(groups / torch.where(amax > 0, block_scale, torch.ones_like(block_scale))).clamp(-127, 127)
    dots = torch.einsum("rgi,ngi->rng", xq.double(), codes.view(n, k // 32, 32).double())
    s = block_scale[:, None, :, 0].double()
    terms = s * scale.double() * dots, s * low.double() * xq.sum(-1).double()[:, None, :]
    return (terms[0] + terms[1]).sum(-1), (terms[0].abs() + terms[1].abs()).sum(-1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_q4a8_matches_the_quantised_math(variant: str, rows: int):
    lib = library(variant)
    for n, k in [*SHAPES, (48, 512)]:
        generator = torch.Generator().manual_seed(rows * n + k)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
        codes[:, :32] = 15  # a group of the largest codes, against a block of the largest activations
        scale = torch.rand(n, k // 32, generator=generator) * 0.01 + 1e-3
        low = -scale * torch.rand(n, k // 32, generator=generator) * 15
        bias, residual = torch.randn(n, generator=generator), torch.randn(rows, n, generator=generator)
        x = torch.randn(rows, k, generator=generator)
        x[0, :32] = 2.5
        x[-1, 32:] = 0  # blocks of zeros (scale 0)
        linear = int8_kernels.packed_q4a8_linear(codes, scale, low, bias, library=lib)
        assert linear is not None
        expected, magnitude = _q4a8_reference(x, codes, scale, low)
        _check(linear, x, bias, residual, expected, magnitude)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_are_checked_and_refused(variant: str):
    lib = library(variant)
    assert int8_kernels.int8_linear_isa(lib) == variant
    weight, scale = torch.ones(48, 64, dtype=torch.int8), torch.ones(48)
    assert int8_kernels.packed_int8_linear(weight[:40], scale[:40], None, library=lib) is None  # 40 outputs
    assert int8_kernels.packed_int8_linear(weight[:, :48], scale, None, library=lib) is None  # not whole 32s
    assert int8_kernels.packed_int8_linear(weight.float(), scale, None, library=lib) is None  # not int8
    with pytest.raises(ValueError):  # an integer scale (NPU checkpoints pack float bits into int64) is not cast
        int8_kernels.packed_int8_linear(weight, scale.long(), None, library=lib)
    with pytest.raises(ValueError):
        int8_kernels.packed_int8_linear(weight, scale, None, quant_bias=torch.ones(48, dtype=torch.int64), library=lib)
    x = torch.randn(3, 64)
    torch.testing.assert_close(int8_kernels.packed_int8_linear(weight, scale[:, None], None, library=lib)(x),
                               int8_kernels.packed_int8_linear(weight, scale, None, library=lib)(x))  # [out, 1]
    codes, groups = torch.ones(48, 64, dtype=torch.uint8), torch.ones(48, 2)
    assert int8_kernels.packed_q4a8_linear(codes[:40], groups[:40], groups[:40], None, library=lib) is None
    assert int8_kernels.packed_q4a8_linear(codes[:, :48], groups, groups, None, library=lib) is None
    for linear in (int8_kernels.packed_int8_linear(weight, scale, None, library=lib),
                   int8_kernels.packed_q4a8_linear(codes, groups, groups, None, library=lib)):
        x = torch.randn(2, 5, 64)
        assert linear(x).shape == (2, 5, 48)  # leading dimensions kept
        assert linear(x[:, :0]).shape == (2, 0, 48)  # no rows
        torch.testing.assert_close(linear(x[:, ::2]), linear(x[:, ::2].contiguous()))  # strided rows
        with pytest.raises(TypeError):
            linear(x.half())
        with pytest.raises(TypeError):
            linear(x, torch.randn(2, 5, 48).bfloat16())
        with pytest.raises(ValueError):  # shapes the kernel would read past
            linear(torch.randn(5, 60))
        with pytest.raises(ValueError):
            linear(x, torch.randn(2, 4, 48))
