"""The tensors of an HF model directory, read straight from its safetensors
files (one file, or shards listed in model.safetensors.index.json).

The lean path (decoder.py) takes its weights from here, so the worker never
builds transformers' model classes for it: importing their modeling code alone
holds about 90 MiB, and building the model keeps a full second copy of the
weights until the lean layout is made. Checkpoints without safetensors files
load through transformers (model_runner.py).

A quantized checkpoint (quantization.py) answers each quantized linear's
`name.weight` with the weight dequantized from its stored tensors, and
`quantized(prefix)` with the weight as stored, for the linears a platform can
run quantized."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker import quant_formats, quantization

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Tensors read in float32 whatever the run dtype, as transformers keeps them
# (_keep_in_fp32_modules_strict): DeepSeek's expert-selection bias, whose
# rounding to bfloat16 would change which experts a token picks.
KEEP_FLOAT32 = ("e_score_correction_bias",)


class Checkpoint:
    """name -> tensor in one dtype on one device, each read when asked for."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device):
        self.dtype = dtype
        self.device = device
        index = model_dir / _INDEX
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = {}
        files = sorted(set(weight_map.values())) or [_SINGLE]
        self._files = {name: safe_open(str(model_dir / name), framework="pt") for name in files}
        self._where = weight_map or {key: _SINGLE for key in self._files[_SINGLE].keys()}
        self.scheme = quant_formats.detect(model_dir, self._where)
        self._linears = self.scheme.linears if self.scheme is not None else set()

    @staticmethod
    def available(model_dir: Path) -> bool:
        return (model_dir / _INDEX).exists() or (model_dir / _SINGLE).exists()

    def __contains__(self, name: str) -> bool:
        return name in self._where or self._quantized_part(name) is not None

    @property
    def names(self) -> list[str]:
        """Every stored tensor's name."""
        return list(self._where)

    def stored(self, name: str) -> torch.Tensor:
        """A tensor as the file holds it (a quantized format's integers)."""
        return self._files[self._where[name]].get_tensor(name)

    def _quantized_part(self, name: str) -> tuple[str, str] | None:
        """(linear prefix, "weight" or "bias") where `name` is a quantized linear's."""
        prefix, _, part = name.rpartition(".")
        if prefix in self._linears and part in ("weight", "bias"):
            if part == "weight" or self.scheme.bias(prefix, self.stored, self._where.__contains__) is not None:
                return prefix, part
        return None

    def quantized(self, prefix: str) -> quantization.QuantizedWeight | torch.Tensor | None:
        """The linear `prefix` as the checkpoint quantized it: a weight a
        platform's kernels may take as stored, or the float weight (run dtype, on
        the device) where the format reads it dequantized; None where the
        checkpoint does not quantize it."""
        if prefix not in self._linears:
            return None
        weight = self.scheme.load(prefix, self.stored, self._where.__contains__)
        if isinstance(weight, torch.Tensor):
            return weight.to(dtype=self.dtype, device=self.device)
        return dataclasses.replace(weight, dtype=self.dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        quantized = self._quantized_part(name)
        if quantized is not None:
            prefix, part = quantized
            if part == "weight":
                tensor = quantization.as_float(self.scheme.load(prefix, self.stored, self._where.__contains__))
            else:
                tensor = self.scheme.bias(prefix, self.stored, self._where.__contains__)
            return tensor.to(dtype=self.dtype, device=self.device)
        tensor = self.stored(name)
        dtype = torch.float32 if name.endswith(KEEP_FLOAT32) else self.dtype
        # Always a copy: a tensor left on the file's mapping would keep the whole
        # file's pages resident for as long as the worker runs.
        return tensor.to(dtype=dtype, device=self.device, copy=True)

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self else None
