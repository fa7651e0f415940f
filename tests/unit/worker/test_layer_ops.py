"""The one-pass CPU layer ops (cpu_kernels.LayerOps) equal the torch ops
(platforms.TorchLayerOps) they replace, on the layouts the lean decoder hands
them: strided rows (views into the fused QKV output), decode-sized and
prefill-sized row counts, and gate values far out in both tails."""
from __future__ import annotations

import pytest
import torch

from services.worker import cpu_kernels
from services.worker.platforms import TorchLayerOps

# Both compute in float32; bfloat16 results may differ by the final rounding
# (the torch ops round between their passes, the kernels once).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _ops(dtype: torch.dtype) -> cpu_kernels.LayerOps:
    ops = cpu_kernels.layer_ops(dtype, hidden_size=96, intermediate_size=64, head_dim=64)
    assert ops is not None, "no kernels: is a C compiler installed?"
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 700])
def test_rms_norm(dtype, rows):
    torch.manual_seed(rows)
    wide = torch.randn(rows, 160, dtype=dtype) * 3
    x = wide[:, 16:112]  # rows 160 apart, as a view into a wider output
    weight = torch.randn(96, dtype=dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(_ops(dtype).rms_norm(x, weight, 1e-5), TorchLayerOps.rms_norm(x, weight, 1e-5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 700])
def test_silu_mul(dtype, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 128, dtype=dtype) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # past exp's float32 range both ways
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(_ops(dtype).silu_mul(gate_up), TorchLayerOps.silu_mul(gate_up), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 700])
def test_rotary_in_place_on_a_strided_view(dtype, rows):
    torch.manual_seed(rows)
    qkv = torch.randn(rows, 5 * 64, dtype=dtype)
    qk = qkv[:, : 4 * 64].view(rows, 4, 64)  # Q and K heads of a fused QKV output
    angles = torch.rand(rows, 32) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    expected = TorchLayerOps.rotate(qk.clone(), cos, sin)
    v = qkv[:, 4 * 64 :].clone()
    rotated = _ops(dtype).rotate(qk, cos, sin)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(rotated, expected, atol=tol, rtol=tol)
    assert rotated.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, 4 * 64 :], v)  # V untouched


@pytest.mark.parametrize(
    ("dtype", "hidden", "intermediate", "head_dim"),
    [(torch.float16, 96, 64, 64), (torch.float32, 100, 64, 64), (torch.float32, 96, 64, 80)],
)
def test_sizes_without_kernels_fall_back(dtype, hidden, intermediate, head_dim):
    """float16, a width that is not a multiple of 16, a head size that is not one of 32."""
    assert cpu_kernels.layer_ops(dtype, hidden, intermediate, head_dim) is None
