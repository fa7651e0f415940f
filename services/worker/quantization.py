"""Quantized checkpoints as they are published, read by one layer: the weight
types a quantized linear is read as, and how the decoder asks for them. The
formats (which file says what, how each packs its tensors, what is refused)
are in quant_formats.py.

The format is detected from the model directory: msModelSlim's
`quant_model_description.json` (W8A8 static, W8A8_DYNAMIC, W4A16), or the
`quantization_config` of `config.json` (DeepSeek's FP8 blocks, AWQ, GPTQ with
or without act-order, compressed-tensors int8 / int4 / fp8). Each quantized
linear is then read from its stored tensors as one of:

- `Int8Weight`: int8 weights with a scale per output row whose activations the
  format quantizes to int8 too (W8A8, W8A8_DYNAMIC, compressed-tensors W8A8).
  A platform with integer kernels runs them as the format defines
  (`Platform.linear`); any other dequantizes.
- `FourBitWeight`: 4-bit codes with a scale and a low value per group of 32
  inputs (AWQ, GPTQ without act-order, W4A16, compressed-tensors int4, with a
  group size that is a multiple of 32: a group of 128 is four groups of 32 with
  the same scale), which CPU 4-bit kernels take as they are.
- `Fp8BlockWeight`: DeepSeek's FP8 blocks as stored, which CUDA's block-scaled
  FP8 GEMM takes (platforms/cuda_fp8.py);
- a float weight, dequantized exactly from the stored tensors (GPTQ with
  act-order, anything a platform has no kernel for).

`Checkpoint` answers `name.weight` of every quantized linear with its
dequantized float weight, so every path that reads float weights (MLA, experts,
tensor-parallel shards, the MTP module) serves the format's numbers; the
linears that can run quantized ask `quantized(prefix)` instead.

What is not understood is refused when the model loads, naming the tensor and
the format: a type msModelSlim writes that is not listed above, a quant_method
or compressed-tensors format not listed, asymmetric weights where the kernels
assume symmetric ones, a quantized KV cache, sparse weights. Serving such a
checkpoint by casting its integers to floats would answer fluently and wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # the CPU 4-bit kernels' group of inputs (int4.GROUP_SIZE)

class UnsupportedQuantization(ValueError):
    """A quantized checkpoint, or one tensor of it, that cannot be served correctly."""


@dataclass(frozen=True)
class Int8Weight:
    """W8A8: y = (Σ xq·q − offset·Σq) · scale + bias, with xq the activations as
    int8: per tensor, xq = round(x / input_scale + input_offset) (static, as
    msModelSlim's W8A8 calibrates them), or per token, x / (max |x| / 127)
    times that token's scale (dynamic). `scale` [out] is the weight's scale
    (dynamic) or msModelSlim's deq_scale, input_scale times it (static)."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]
    static: tuple[float, int] | None = None  # (input_scale, input_offset)
    dtype: torch.dtype = torch.float32  # the activations' (the run's)

    @property
    def shape(self) -> torch.Size:
        """[out, in], as the float weight's."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight whose linear the quantized one computes, up to the
        activations' int8 rounding."""
        scale = self.scale if self.static is None else self.scale / self.static[0]
        return self.q.float() * scale[:, None]

    def quant_bias(self, bias: torch.Tensor | None) -> torch.Tensor:
        """Static: the int32 [out] that integer kernels add to Σ xq·q before the
        scale, −offset·Σq and the float bias in units of the scale (msModelSlim's
        quant_bias)."""
        assert self.static is not None
        folded = -self.static[1] * self.q.to(torch.int64).sum(1)
        if bias is not None:
            folded = folded + (bias.double().cpu() / self.scale.double()).round().to(torch.int64)
        return folded.to(torch.int32)

    @staticmethod
    def cat(parts: list[Int8Weight]) -> Int8Weight | None:
        """Row blocks side by side (Q/K/V, gate/up), or None where their activations
        are quantized differently (static scales that differ)."""
        if len({p.static for p in parts}) != 1:
            return None
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), parts[0].static,
                          parts[0].dtype)


@dataclass(frozen=True)
class FourBitWeight:
    """weight = codes · scale + low per group of GROUP inputs."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scale: torch.Tensor  # float32 [out, in / GROUP]
    low: torch.Tensor  # float32 [out, in / GROUP]
    dtype: torch.dtype = torch.float32  # the activations' (the run's)

    @property
    def shape(self) -> torch.Size:
        """[out, in], as the float weight's."""
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.codes.shape
        codes = self.codes.float().view(out_features, -1, GROUP)
        return (codes * self.scale[..., None] + self.low[..., None]).view(out_features, in_features)

    @staticmethod
    def cat(parts: list[FourBitWeight]) -> FourBitWeight:
        return FourBitWeight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "low")),
                             parts[0].dtype)


@dataclass(frozen=True)
class Fp8BlockWeight:
    """DeepSeek's FP8: weight = fp8 · scale per block of block[0] outputs × block[1] inputs."""

    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]
    dtype: torch.dtype = torch.float32  # the activations' (the run's)

    @property
    def shape(self) -> torch.Size:
        """[out, in], as the float weight's."""
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * expand_blocks(self.scale, self.weight.shape, self.block)

    @staticmethod
    def cat(parts: list[Fp8BlockWeight]) -> Fp8BlockWeight | None:
        """Row blocks side by side where each part fills whole blocks of rows."""
        if any(p.block != parts[0].block or p.weight.shape[0] % p.block[0] for p in parts[:-1]):
            return None
        return Fp8BlockWeight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]),
                              parts[0].block, parts[0].dtype)


QuantizedWeight = Int8Weight | FourBitWeight | Fp8BlockWeight


def expand_blocks(scale: torch.Tensor, shape, block) -> torch.Tensor:
    """A scale per block of block[0] rows × block[1] columns (the last ones
    partial) expanded to a weight of `shape`."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def as_float(weight: torch.Tensor | QuantizedWeight, device: torch.device | None = None) -> torch.Tensor:
    """A linear's weight in the run's dtype: a quantized one dequantized (on `device`)."""
    if isinstance(weight, torch.Tensor):
        return weight
    return weight.dequantize().to(dtype=weight.dtype, device=device)

def linear_weight(weights, prefixes: list[str]) -> torch.Tensor | QuantizedWeight:
    """The weight of one linear made of the row blocks `prefixes` (Q/K/V, gate/up):
    as the checkpoint quantized it, where it did so alike for every block and
    `weights` can say (a Checkpoint), else float."""
    quantized = getattr(weights, "quantized", None)
    parts = [quantized(p) if quantized is not None else None for p in prefixes]
    # Read once: a part the checkpoint does not quantize comes as its float weight.
    parts = [weights[p + ".weight"] if part is None else part for p, part in zip(prefixes, parts)]
    if all(isinstance(p, Int8Weight) for p in parts):
        fused = Int8Weight.cat(parts)
        if fused is not None:
            return fused
    if all(isinstance(p, FourBitWeight) for p in parts):
        return FourBitWeight.cat(parts)
    if all(isinstance(p, Fp8BlockWeight) for p in parts):
        fused = Fp8BlockWeight.cat(parts)
        if fused is not None:
            return fused
    if all(isinstance(part, torch.Tensor) for part in parts):
        return torch.cat(parts)
    return torch.cat([weights[p + ".weight"] for p in prefixes])  # kinds that do not fuse: their float weights
