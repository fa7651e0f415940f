"""The backend's prepared linear equals F.linear on every path it takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker import cpu_kernels, int8_kernels
from services.worker.platforms import select_platform
from services.worker.platforms.cpu import cpu_computes_bfloat16
from services.worker.int4 import four_bit_codes, int4_linear, pack_for_torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepared_linear_matches_f_linear(dtype: torch.dtype, rows: int, with_bias: bool):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80, dtype=dtype)
    bias = torch.randn(96, dtype=dtype) if with_bias else None
    linear = select_platform("cpu").linear(weight, bias)
    x = torch.randn(rows, 80, dtype=dtype)
    # bfloat16: both accumulate in float32 and round once; block order may differ.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=tolerance * 10, rtol=tolerance)


@pytest.mark.skipif(not cpu_kernels.bfloat16_linear_available(),
                    reason="the bfloat16 linear kernel needs AVX512_BF16, or AVX2 without AVX-512")
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 33])  # whole and partial tiles of 6 (AVX2) or 8 rows
@pytest.mark.parametrize("out_features", [16, 32, 48, 80])  # whole and partial 48-output strips
def test_bfloat16_kernel_adds_bias_and_residual_and_rounds_once(rows: int, out_features: int):
    torch.manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, 96), torch.randn(out_features)
    x, residual = torch.randn(rows, 96), torch.randn(rows, out_features)
    linear = cpu_kernels.packed_linear(weight.bfloat16(), bias.bfloat16())
    assert linear is not None
    exact = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias.bfloat16().float())
    # Float32 sums, one rounding to bfloat16 at the end: within half a bfloat16 step.
    torch.testing.assert_close(linear(x.bfloat16()).float(), exact, atol=1e-2, rtol=2 ** -8)
    with_residual = exact + residual.bfloat16().float()
    torch.testing.assert_close(linear(x.bfloat16(), residual.bfloat16()).float(), with_residual, atol=1e-2,
                               rtol=2 ** -8)
    # A 3-d input keeps its leading dimensions; float32 activations are refused, not misread.
    assert linear(x.bfloat16().view(1, rows, 96)).shape == (1, rows, out_features)
    with pytest.raises(TypeError):
        linear(x)
    # Shapes the kernel would read past are refused, as F.linear refuses them.
    with pytest.raises(ValueError):
        linear(torch.randn(rows, 95).bfloat16())
    with pytest.raises(ValueError):
        linear(x.bfloat16(), torch.randn(rows + 1, out_features).bfloat16())


def test_bfloat16_kernel_is_declined_where_its_layout_does_not_fit():
    assert cpu_kernels.packed_linear(torch.randn(40, 96, dtype=torch.bfloat16), None) is None  # 40 outputs
    assert cpu_kernels.packed_linear(torch.randn(48, 95, dtype=torch.bfloat16), None) is None  # odd inputs
    assert cpu_kernels.packed_linear(torch.randn(48, 96), None) is None  # float32


def _four_bit_weight(out_features: int, in_features: int) -> torch.Tensor:
    """What dequantizing a Q4_1 tensor gives: per group of 32, code * scale + min,
    the group spanning zero as trained weights do. Every group uses codes 0 and 15."""
    codes = torch.randint(0, 16, (out_features, in_features // 32, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = torch.rand(out_features, in_features // 32, 1) * 0.01 + 0.001
    low = -scale * torch.rand(out_features, in_features // 32, 1) * 15
    return (codes * scale + low).view(out_features, in_features)


def test_exactly_4bit_weights_are_recognised_and_nothing_else():
    torch.manual_seed(0)
    weight = _four_bit_weight(64, 96)
    four_bit = four_bit_codes(weight.bfloat16())
    assert four_bit is not None
    codes, scale, low = four_bit
    assert codes.dtype == torch.uint8 and int(codes.max()) == 15 and int(codes.min()) == 0
    rebuilt = codes.float().view(64, 3, 32) * scale[..., None] + low[..., None]
    torch.testing.assert_close(rebuilt.view(64, 96), weight, atol=2e-3, rtol=0)  # within bfloat16's rounding
    assert four_bit_codes(torch.randn(64, 96, dtype=torch.bfloat16)) is None  # a real bf16 weight
    assert four_bit_codes(_four_bit_weight(64, 96).bfloat16()[:, :72]) is None  # not whole groups


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 13, 40])  # a 4-bit kernel up to 4, 8 or 12 rows, the batched one above
def test_4bit_weights_give_the_same_products_on_either_kernel(rows: int):
    torch.manual_seed(rows)
    weight = _four_bit_weight(96, 128)
    bias = torch.randn(96)
    linear = select_platform("cpu").linear(weight.bfloat16(), bias.bfloat16())
    x = torch.randn(rows, 128)
    expected = F.linear(x, weight, bias)
    got = linear(x.bfloat16()).float()
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
    # The int4 kernel itself, also where the backend does not pick it.
    four_bit = four_bit_codes(weight.bfloat16())
    assert four_bit is not None
    got = (int4_linear(x.bfloat16(), *pack_for_torch(*four_bit, torch.bfloat16)) + bias.bfloat16()).float()
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)


@pytest.mark.skipif(not cpu_kernels.q4_linear_available(),
                    reason="the 4-bit kernel is built for AVX512_BF16 and AVX2-only CPUs")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 12, 13])  # whole and partial tiles (4 rows on AVX2, 12 on AVX-512)
@pytest.mark.parametrize("out_features", [16, 48, 112])  # whole and partial strips, 1 to 7 blocks
def test_4bit_kernel_adds_bias_and_residual_and_rounds_once(rows: int, out_features: int):
    torch.manual_seed(rows * out_features)
    codes = torch.randint(0, 16, (out_features, 96), dtype=torch.uint8)
    # float16 values, as a GGUF stores them (the AVX2 build keeps them in float16).
    scale = (torch.rand(out_features, 3) * 0.01 + 0.001).half().float()
    low = (-scale * torch.rand(out_features, 3) * 15).half().float()
    bias, residual = torch.randn(out_features).bfloat16(), torch.randn(rows, out_features).bfloat16()
    linear = cpu_kernels.packed_q4_linear(codes, scale, low, bias)
    assert linear is not None
    weight = (codes.float().view(out_features, 3, 32) * scale[..., None] + low[..., None]).view(out_features, 96)
    x = torch.randn(rows, 96).bfloat16()
    exact = F.linear(x.float(), weight, bias.float())
    torch.testing.assert_close(linear(x).float(), exact, atol=1e-2, rtol=2 ** -8)
    torch.testing.assert_close(linear(x, residual).float(), exact + residual.float(), atol=1e-2, rtol=2 ** -8)
    assert cpu_kernels.packed_q4_linear(codes[:, :80], scale, low, None) is None  # not whole groups
    eight_outputs = cpu_kernels.packed_q4_linear(codes[:8], scale[:8], low[:8], None)
    assert (eight_outputs is None) == cpu_kernels.cpu_has("avx512_bf16")  # blocks of 16 outputs there, 8 on AVX2


def test_auto_dtype_is_bfloat16_only_where_the_cpu_runs_it_fast():
    cpu = select_platform("cpu")
    native = cpu_computes_bfloat16() or cpu_kernels.bfloat16_linear_available()
    assert cpu.resolve_dtype("auto") == ("bfloat16" if native else "float32")
    assert [cpu.resolve_dtype(name) for name in ("bfloat16", "float16", "float32")] == ["bfloat16", "float16", "float32"]


def _spanning_four_bit_weight(out_features: int, in_features: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator).float()
    groups = in_features // 32
    scale = (torch.rand(out_features, groups, generator=generator) * 0.01 + 0.01).repeat_interleave(32, 1)
    low = -8 * scale  # values around zero, as a Q4_0 block's
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans its 16 levels
    return (codes * scale + low).to(torch.bfloat16)


@pytest.mark.skipif(not int8_kernels.q4a8_linear_available(), reason="int8.c's kernels are not built here")
def test_int8_activations_run_4bit_weights_on_the_w4a8_kernel_at_every_step_size():
    from services.worker.platforms.cpu import CpuPlatform

    weight = _spanning_four_bit_weight(64, 128)
    platform = CpuPlatform(torch.device("cpu"))
    platform.set_activations("int8")
    linear = platform.linear(weight, None)
    if not torch.cpu._is_amx_tile_supported():
        assert isinstance(linear, int8_kernels.QuantizedLinear)  # no bfloat16 copy for larger steps
    for rows in (1, 40):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        exact = x.float() @ weight.float().t()
        # Activations rounded to int8 per group of 32: about 1 % of a product's size.
        assert (linear(x).float() - exact).abs().max() < 0.02 * exact.abs().max()
    platform.set_activations("bfloat16")
    assert not isinstance(platform.linear(weight, None), int8_kernels.QuantizedLinear)


def test_int8_activations_are_a_cpu_setting(monkeypatch):
    from services.worker.platforms.base import Platform
    from services.worker.platforms.cpu import CpuPlatform

    class Other(Platform):
        name = "other"

    with pytest.raises(ValueError, match="CPU only, not other"):
        Other(torch.device("cpu")).set_activations("int8")
    monkeypatch.setattr(int8_kernels, "q4a8_linear_available", lambda library=None: False)
    platform = CpuPlatform(torch.device("cpu"))
    with pytest.raises(ValueError, match="int8.c's kernels"):
        platform.set_activations("int8")
    platform.set_activations("auto")  # falls back where nothing is built
    assert not platform.int8_activations


@pytest.mark.skipif(not int8_kernels.int8_linear_available(), reason="int8.c's kernels are not built here")
@pytest.mark.parametrize("static", [None, (0.02, -3)])
def test_w8a8_on_amx_int8_takes_large_steps_to_onednn_with_the_same_integer_sums(static, monkeypatch):
    """Where the CPU has AMX-INT8 (claimed here), steps of _INT8_AMX_MIN_ROWS rows
    or more run torch._int_mm; the int32 sums are int8.c's, so the outputs agree
    to float32 rounding, and fewer rows still run int8.c."""
    from services.worker.platforms import cpu
    from services.worker.quantization import Int8Weight

    generator = torch.Generator().manual_seed(7)
    weight = Int8Weight(torch.randint(-127, 128, (48, 96), generator=generator, dtype=torch.int8),
                        torch.rand(48, generator=generator) * 1e-2 + 1e-3, static, torch.float32)
    bias = torch.randn(48, generator=generator) * 0.1
    platform = cpu.CpuPlatform(torch.device("cpu"))
    plain = platform.linear(weight, bias)
    monkeypatch.setattr(cpu_kernels, "cpu_has", lambda flag: flag == "amx_int8" or flag in cpu_kernels._cpu_flags())
    with_amx = platform.linear(weight, bias)
    calls, int_mm = [], torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape[0]) or int_mm(a, b))
    for rows in (3, cpu._INT8_AMX_MIN_ROWS + 5):
        x = torch.randn(rows, 96, generator=generator) * 0.6
        torch.testing.assert_close(with_amx(x), plain(x), atol=1e-4, rtol=1e-5)
    assert calls == [cpu._INT8_AMX_MIN_ROWS + 5]
