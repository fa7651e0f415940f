"""The backend's prepared linear equals F.linear on every path it takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.backend import select_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepared_linear_matches_f_linear(dtype: torch.dtype, rows: int, with_bias: bool):
    torch.manual_seed(rows)
    weight = torch.randn(96, 80, dtype=dtype)
    bias = torch.randn(96, dtype=dtype) if with_bias else None
    linear = select_backend("cpu").linear(weight, bias)
    x = torch.randn(rows, 80, dtype=dtype)
    # bfloat16: both accumulate in float32 and round once; block order may differ.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=tolerance * 10, rtol=tolerance)
