"""The fake torch_npu's quantized matmuls (the package docstring says what a
reference op here is), under op-plugin's schemas
(op_plugin/config/op_plugin_functions.yaml), with the semantics of Ascend's
documentation as vllm-ascend calls them for msModelSlim's W8A8, W8A8_DYNAMIC
and W4A16 linears (quantization/methods/w8a8_static.py, w8a8_dynamic.py):

- npu_dynamic_quant: per-token symmetric int8, scale = max |x| / 127 over the
  last dimension, returned in float32 beside the int8 values;
- npu_quantize (div_mode): round(x / scales + zero_points) into int8;
- npu_quant_matmul: (x1 · x2 + int32 bias) · scale [· pertoken_scale], or a
  float bias added after the scales, in output_dtype;
- npu_weight_quant_batchmatmul: x · ((weight + antiquant_offset) ·
  antiquant_scale) + bias, per channel or per group of antiquant_group_size
  rows of the [k, n] weight.

Dtype arguments arrive as ScalarType codes (the schemas' `int?`). The ops take
float16 / bfloat16 activations only, as the devices do.

Imported by the package's __init__ (its library fragment and _check)."""
from __future__ import annotations

import torch

from torch_npu import _LIBRARY, _check

QUANT_SCHEMAS = {
    "npu_dynamic_quant": (
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, int? "
        "dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)"
    ),
    "npu_quantize": (
        "npu_quantize(Tensor self, Tensor scales, Tensor? zero_points, int dtype, int axis=1, bool div_mode=True) "
        "-> Tensor"
    ),
    "npu_quant_matmul": (
        "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, int? "
        "pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor"
    ),
    "npu_weight_quant_batchmatmul": (
        "npu_weight_quant_batchmatmul(Tensor x, Tensor weight, Tensor antiquant_scale, Tensor? antiquant_offset=None, "
        "Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? bias=None, int antiquant_group_size=0, int "
        "inner_precise=0, int? weight_dtype=None) -> Tensor"
    ),
}
# ScalarType codes of the dtypes these ops take.
_DTYPES = {1: torch.int8, 5: torch.float16, 6: torch.float32, 12: torch.int8, 15: torch.bfloat16}  # 12: qint8
_ACTIVATIONS = (torch.float16, torch.bfloat16)


def _dynamic_quant(x, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0):
    _check(x.dtype in _ACTIVATIONS, f"npu_dynamic_quant takes float16/bfloat16 input, not {x.dtype}")
    _check(smooth_scales is None and group_index is None and quant_mode == "pertoken",
           "only per-token quantization without smoothing is modelled")
    _check(dst_type in (None, 1), f"dst_type {dst_type}: int8 only is modelled")
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = (x / torch.where(scale > 0, scale, 1)[..., None]).round().clamp(-128, 127).to(torch.int8)
    return q, scale


def _quantize(x, scales, zero_points, dtype, axis=1, div_mode=True):
    _check(_DTYPES.get(dtype) is torch.int8, f"npu_quantize: dtype {dtype} is not int8/qint8")
    _check(div_mode, "div_mode=False (multiply by scales) is not what our calls use")
    shape = [1] * x.dim()
    shape[axis] = -1
    _check(scales.numel() in (1, x.shape[axis]), f"npu_quantize: {scales.numel()} scales for axis of {x.shape[axis]}")
    y = x.float() / scales.float().reshape(shape if scales.numel() > 1 else [1])
    if zero_points is not None:
        y = y + zero_points.float().reshape(shape if zero_points.numel() > 1 else [1])
    return y.round().clamp(-128, 127).to(torch.int8)


def _quant_matmul(x1, x2, scale, offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
                  x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None):
    _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, f"npu_quant_matmul takes int8 x1/x2, "
           f"not {x1.dtype}/{x2.dtype}")
    _check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
           f"npu_quant_matmul: x1 {tuple(x1.shape)} times x2 {tuple(x2.shape)} (x2 is [k, n])")
    out_dtype = _DTYPES.get(output_dtype, torch.int8) if output_dtype is not None else torch.int8
    _check(out_dtype in _ACTIVATIONS, f"output_dtype {output_dtype}: float16/bfloat16 are modelled")
    n = x2.shape[1]
    _check(scale.dtype == torch.float32 and scale.numel() in (1, n), f"scale {scale.dtype} {tuple(scale.shape)}")
    _check(offset is None, "offset (int8 output) is not modelled")
    acc = x1.to(torch.int64) @ x2.to(torch.int64)
    float_bias = None
    if bias is not None:
        _check(bias.numel() == n, f"bias of {bias.numel()} for {n} outputs")
        if bias.dtype == torch.int32:
            acc = acc + bias.to(torch.int64)
        else:
            float_bias = bias.float()
    y = acc.double() * scale.double().reshape(1, -1)
    if pertoken_scale is not None:
        _check(pertoken_scale.dtype == torch.float32 and pertoken_scale.shape == (x1.shape[0],),
               f"pertoken_scale {pertoken_scale.dtype} {tuple(pertoken_scale.shape)}")
        y = y * pertoken_scale.double()[:, None]
    if float_bias is not None:
        y = y + float_bias
    return y.to(out_dtype)


def _weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None,
                              bias=None, antiquant_group_size=0, inner_precise=0, weight_dtype=None):
    _check(x.dtype in _ACTIVATIONS, f"npu_weight_quant_batchmatmul takes float16/bfloat16 x, not {x.dtype}")
    _check(weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[0] == x.shape[-1],
           f"weight {weight.dtype} {tuple(weight.shape)} for x {tuple(x.shape)} (weight is [k, n] int8)")
    _check(quant_scale is None and quant_offset is None, "quantized output is not modelled")
    k, n = weight.shape
    group = antiquant_group_size or k
    _check(k % group == 0 and antiquant_scale.shape == (k // group, n) or antiquant_scale.numel() in (1, n),
           f"antiquant_scale {tuple(antiquant_scale.shape)} for a [{k}, {n}] weight in groups of {group}")
    _check(antiquant_scale.dtype == x.dtype, "antiquant_scale must have x's dtype")
    scale = antiquant_scale.float().reshape(-1, n).repeat_interleave(group if antiquant_scale.numel() > n else k, 0)
    w = weight.float()
    if antiquant_offset is not None:
        _check(antiquant_offset.shape == antiquant_scale.shape, "antiquant_offset must be shaped as the scale")
        w = w + antiquant_offset.float().reshape(-1, n).repeat_interleave(
            group if antiquant_offset.numel() > n else k, 0)
    y = x.float() @ (w * scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


for _name, _impl in [("npu_dynamic_quant", _dynamic_quant), ("npu_quantize", _quantize),
                     ("npu_quant_matmul", _quant_matmul),
                     ("npu_weight_quant_batchmatmul", _weight_quant_batchmatmul)]:
    _LIBRARY.define(QUANT_SCHEMAS[_name])
    _LIBRARY.impl(_name, _impl, "CPU")
