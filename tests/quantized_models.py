"""Tiny models written in each quantized format the worker reads, from a float
model's weights, with the float weights each format's tensors stand for (the
reference the worker's logits are held to).

Each writer here is a reference quantiser written from the format's own
description, independent of services/worker/quantization.py: AWQ's and GPTQ's
packing orders, DeepSeek's FP8 blocks, msModelSlim's W4A16. compressed-tensors
checkpoints are written by the `compressed-tensors` package itself, and
msModelSlim W8A8 / W8A8_DYNAMIC by our quantize command."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in state if _LINEAR.match(n))


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [..., 32 / bits · w] packed into int32 words [..., w], the
    first value in the lowest bits (written out value by value)."""
    per_word = 32 // bits
    values = values.to(torch.int64).view(*values.shape[:-1], -1, per_word)
    word = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for i in range(per_word):
        word |= values[..., i] << (bits * i)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _asymmetric_groups(weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None):
    """4-bit asymmetric min/max quantization of weight [out, in] in groups of inputs:
    (q [out, in] 0..15, scale float16 [out, groups], zero [out, groups] 0..15,
    the float weight they stand for)."""
    out_features, in_features = weight.shape
    groups = g_idx if g_idx is not None else torch.arange(in_features) // group_size
    num_groups = int(groups.max()) + 1
    scale = torch.empty(out_features, num_groups)
    zero = torch.empty(out_features, num_groups)
    for g in range(num_groups):
        block = weight[:, groups == g]
        low, high = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
        scale[:, g] = ((high - low) / 15).clamp(min=1e-6)
        zero[:, g] = (-low / scale[:, g]).round().clamp(0, 15)
    scale = scale.half()
    q = (weight / scale.float()[:, groups] + zero[:, groups]).round().clamp(0, 15)
    reference = (q - zero[:, groups]) * scale.float()[:, groups]
    return q.to(torch.int64), scale, zero.to(torch.int64), reference


def awq(state: dict[str, torch.Tensor], group_size: int = 128):
    """AWQ's GEMM layout: qweight [in, out / 8] and qzeros [groups, out / 8] with
    output j of each eight in nibble (0, 4, 1, 5, 2, 6, 3, 7)[j], scales [groups, out]."""
    stored, reference = dict(state), dict(state)
    nibble_of = (0, 4, 1, 5, 2, 6, 3, 7)
    for name in linear_names(state):
        prefix = name.removesuffix(".weight")
        q, scale, zero, reference[name] = _asymmetric_groups(state.pop(name).float(), group_size)
        del stored[name]

        def pack(values):  # [rows, out] -> [rows, out / 8]
            rows, out = values.shape
            ordered = torch.empty_like(values).view(rows, out // 8, 8)
            for j in range(8):
                ordered[..., nibble_of[j]] = values.view(rows, out // 8, 8)[..., j]
            return _words(ordered.view(rows, out), 4)

        stored[prefix + ".qweight"] = pack(q.t().contiguous())
        stored[prefix + ".qzeros"] = pack(zero.t().contiguous())
        stored[prefix + ".scales"] = scale.t().contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return stored, reference, config


def gptq(state: dict[str, torch.Tensor], group_size: int = 128, act_order: bool = False, seed: int = 0):
    """GPTQ (checkpoint_format gptq): qweight [in / 8, out] packed along the inputs,
    qzeros [groups, out / 8] holding zero − 1, scales [groups, out], g_idx [in]
    (a shuffled order of groups with act_order, as desc_act writes)."""
    stored, reference = dict(state), dict(state)
    generator = torch.Generator().manual_seed(seed)
    for name in linear_names(state):
        prefix = name.removesuffix(".weight")
        weight = state[name].float()
        in_features = weight.shape[1]
        g_idx = torch.arange(in_features) // group_size
        if act_order:
            g_idx = g_idx[torch.randperm(in_features, generator=generator)]
        q, scale, zero, reference[name] = _asymmetric_groups(weight, group_size, g_idx)
        del stored[name]
        # Input 8r + i of each output in nibble i of row r.
        stored[prefix + ".qweight"] = _words(q, 4).t().contiguous()
        stored[prefix + ".qzeros"] = _words((zero - 1).t().contiguous(), 4)
        stored[prefix + ".scales"] = scale.t().contiguous()
        stored[prefix + ".g_idx"] = g_idx.to(torch.int32)
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
              "checkpoint_format": "gptq"}
    return stored, reference, config


def fp8_blocks(state: dict[str, torch.Tensor], block: int = 128):
    """DeepSeek-V3's FP8: float8_e4m3fn weights with a float32 weight_scale_inv per
    block × block (the last blocks partial), the scale that multiplies back."""
    stored, reference = dict(state), dict(state)
    for name in linear_names(state):
        weight = state[name].float()
        rows, cols = weight.shape
        scale = torch.empty(-(-rows // block), -(-cols // block))
        quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        dequantized = torch.empty(rows, cols)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
                scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448
                q = (tile / scale[i, j]).to(torch.float8_e4m3fn)
                quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = q
                dequantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = q.float() * scale[i, j]
        stored[name], reference[name] = quantized, dequantized
        stored[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [block, block]}
    return stored, reference, config


def modelslim_w4a16(state: dict[str, torch.Tensor], group_size: int = 32):
    """msModelSlim W4A16 as vllm-ascend reads it: weight_packed int32 [out, in / 8]
    of signed values + 8, weight_scale and (zero) weight_offset [out, groups]."""
    stored, reference = dict(state), dict(state)
    description = {"model_quant_type": "W4A16", "group_size": group_size}
    for name in linear_names(state):
        prefix = name.removesuffix(".weight")
        weight = state[name].float()
        out_features, in_features = weight.shape
        groups = weight.view(out_features, -1, group_size)
        scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
        q = (groups / scale[..., None]).round().clamp(-8, 7)
        reference[name] = (q * scale[..., None]).view(out_features, in_features)
        del stored[name]
        stored[prefix + ".weight_packed"] = _words((q + 8).view(out_features, in_features), 4)
        stored[prefix + ".weight_scale"] = scale
        stored[prefix + ".weight_offset"] = torch.zeros_like(scale)
        for part in ("weight_packed", "weight_scale", "weight_offset"):
            description[f"{prefix}.{part}"] = "W4A16"
    for name in stored:
        description.setdefault(name, "FLOAT")
    return stored, reference, description


def modelslim_w8a8_static(state: dict[str, torch.Tensor], input_scale: float = 0.05, input_offset: int = 3):
    """msModelSlim W8A8 with one fixed input scale and offset for every linear (no
    calibration): int8 weights per row, deq_scale, and quant_bias =
    round(bias / deq_scale) − input_offset · Σ weight, the float bias dropped."""
    stored = dict(state)
    description = {"model_quant_type": "W8A8"}
    for name in linear_names(state):
        prefix = name.removesuffix(".weight")
        weight = stored.pop(name).float()
        scale = weight.abs().amax(1) / 127
        q = (weight / scale[:, None]).round().clamp(-127, 127)
        deq = scale * input_scale
        bias = stored.pop(prefix + ".bias", torch.zeros(weight.shape[0])).float()
        quant_bias = (bias / deq).round() - input_offset * q.sum(1)
        parts = {"weight": q.to(torch.int8), "input_scale": torch.tensor([input_scale]),
                 "input_offset": torch.tensor([float(input_offset)]), "deq_scale": deq,
                 "quant_bias": quant_bias.to(torch.int32), "weight_scale": scale[:, None],
                 "weight_offset": torch.zeros(weight.shape[0], 1)}
        for part, tensor in parts.items():
            stored[f"{prefix}.{part}"] = tensor
            description[f"{prefix}.{part}"] = "W8A8"
    for name in stored:
        description.setdefault(name, "FLOAT")
    return stored, description


def compressed_tensors(state: dict[str, torch.Tensor], kind: str):
    """Through the compressed-tensors package: "int4" (pack-quantized, symmetric,
    groups of 32), "int8" (int-quantized per channel, dynamic per-token int8
    activations) or "fp8" (float-quantized, 32 × 32 blocks)."""
    from compressed_tensors.compressors import (FloatQuantizationCompressor, IntQuantizationCompressor,
                                                PackedQuantizationCompressor)
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, dequantize, quantize

    if kind == "int4":
        args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
        compressor, fmt, activations = PackedQuantizationCompressor(), "pack-quantized", None
    elif kind == "int8":
        args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        compressor, fmt = IntQuantizationCompressor(), "int-quantized"
    else:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[32, 32])
        compressor, fmt, activations = FloatQuantizationCompressor(), "float-quantized", None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=activations)
    stored, reference = dict(state), dict(state)
    for name in linear_names(state):
        prefix = name.removesuffix(".weight")
        weight = state[name].float()
        rows, cols = weight.shape
        if kind == "int4":
            scale = weight.view(rows, -1, 32).abs().amax(-1) / 7.5
        elif kind == "int8":
            scale = weight.abs().amax(1, keepdim=True) / 127
        else:
            scale = torch.stack([torch.stack([weight[i:i + 32, j:j + 32].abs().max() / 448
                                              for j in range(0, cols, 32)]) for i in range(0, rows, 32)])
        scale = scale.clamp(min=1e-8)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        reference[name] = dequantize(quantize(weight, scale, zero, args), scale, zero, args)
        del stored[name]
        for part, tensor in compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero},
                                                scheme=scheme).items():
            stored[f"{prefix}.{part}"] = tensor
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"]).model_dump(
        mode="json", exclude_none=True)
    return stored, reference, {**config, "quant_method": "compressed-tensors"}


def write(directory: Path, source: Path, stored: dict[str, torch.Tensor], quantization: dict | None = None,
          description: dict | None = None) -> Path:
    """A model directory: `source`'s config (with `quantization` as its
    quantization_config) and other files, `stored` as its weights."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            (directory / path.name).write_bytes(path.read_bytes())
    if quantization is not None:
        config = json.loads((source / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}, indent=2))
    if description is not None:
        (directory / "quant_model_description.json").write_text(json.dumps(description, indent=2))
    save_file({k: v.contiguous() for k, v in stored.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
