"""Quantized linears on Ascend, as vllm-ascend runs msModelSlim's checkpoints
(quantization/methods/w8a8_static.py, w8a8_dynamic.py, w4a16.py):

- W8A8_DYNAMIC: npu_dynamic_quant quantizes each token's activations to int8
  with its own scale, npu_quant_matmul multiplies by the int8 weight [k, n]
  and applies both scales;
- W8A8 (static): npu_quantize with the calibrated per-tensor scale and offset,
  npu_quant_matmul with deq_scale and an int32 bias that carries the offset's
  share (− offset · Σ weight) and the float bias;
- 4-bit weights (W4A16, AWQ, GPTQ): npu_weight_quant_batchmatmul over the
  codes as int8 with a scale and an offset per group of 32 inputs.

The ops take float16 / bfloat16 activations; other runs (float32) dequantize."""
from __future__ import annotations

import torch

from services.worker.platforms.base import Linear
from services.worker.quantization import GROUP, FourBitWeight, Int8Weight

ACTIVATIONS = (torch.float16, torch.bfloat16)


class NpuInt8Linear:
    def __init__(self, torch_npu, weight: Int8Weight, bias: torch.Tensor | None, device: torch.device):
        self._npu = torch_npu
        self._dtype = weight.dtype
        self._weight = weight.q.t().contiguous().to(device)  # [k, n], as npu_quant_matmul takes it
        self._scale = weight.scale.float().contiguous().to(device)
        self._static = weight.static
        self._bias = None if bias is None else bias.to(device=device, dtype=weight.dtype)
        if weight.static is not None:
            input_scale, input_offset = weight.static
            in_features = weight.q.shape[1]
            self._input_scale = torch.full((in_features,), input_scale, dtype=weight.dtype, device=device)
            self._input_offset = torch.full((in_features,), input_offset, dtype=weight.dtype, device=device)
            self._quant_bias = weight.quant_bias(bias).to(device)
            self._bias = None  # in quant_bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self._static is None:
            xq, token_scale = self._npu.npu_dynamic_quant(x)
            y = self._npu.npu_quant_matmul(xq, self._weight, self._scale, pertoken_scale=token_scale.flatten(),
                                           bias=self._bias, output_dtype=self._dtype)
        else:
            xq = self._npu.npu_quantize(x, self._input_scale, self._input_offset, torch.qint8, -1, True)
            y = self._npu.npu_quant_matmul(xq, self._weight, self._scale, bias=self._quant_bias,
                                           output_dtype=self._dtype)
        y = y.reshape(*shape[:-1], -1)
        return y if residual is None else y + residual


class NpuFourBitLinear:
    def __init__(self, torch_npu, weight: FourBitWeight, bias: torch.Tensor | None, device: torch.device):
        self._npu = torch_npu
        # weight = codes · scale + low = ((codes − 8) + offset) · scale, offset = low / scale + 8.
        self._weight = (weight.codes.to(torch.int16) - 8).to(torch.int8).t().contiguous().to(device)
        self._scale = weight.scale.t().contiguous().to(device=device, dtype=weight.dtype)
        self._offset = (weight.low / weight.scale + 8).t().contiguous().to(device=device, dtype=weight.dtype)
        self._bias = None if bias is None else bias.to(device=device, dtype=weight.dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        y = self._npu.npu_weight_quant_batchmatmul(x.reshape(-1, shape[-1]), self._weight, self._scale,
                                                   antiquant_offset=self._offset, bias=self._bias,
                                                   antiquant_group_size=GROUP)
        y = y.reshape(*shape[:-1], -1)
        return y if residual is None else y + residual


def quantized_linear(torch_npu, weight, bias: torch.Tensor | None, device: torch.device) -> Linear | None:
    """The NPU linear for a quantized weight, or None where the ops do not take it."""
    if getattr(weight, "dtype", None) not in ACTIVATIONS:
        return None
    if isinstance(weight, Int8Weight):
        return NpuInt8Linear(torch_npu, weight, bias, device)
    if isinstance(weight, FourBitWeight) and bool((weight.scale > 0).all()):
        return NpuFourBitLinear(torch_npu, weight, bias, device)
    return None
