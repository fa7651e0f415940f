"""The tensors of an HF model directory, read straight from its safetensors
files (one file, or shards listed in model.safetensors.index.json).

The lean path (decoder.py) takes its weights from here, so the worker never
builds transformers' model classes for it: importing their modeling code alone
holds about 90 MiB, and building the model keeps a full second copy of the
weights until the lean layout is made. Checkpoints without safetensors files
load through transformers (model_runner.py)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

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

    @staticmethod
    def available(model_dir: Path) -> bool:
        return (model_dir / _INDEX).exists() or (model_dir / _SINGLE).exists()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._files[self._where[name]].get_tensor(name)
        dtype = torch.float32 if name.endswith(KEEP_FLOAT32) else self.dtype
        # Always a copy: a tensor left on the file's mapping would keep the whole
        # file's pages resident for as long as the worker runs.
        return tensor.to(dtype=dtype, device=self.device, copy=True)

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self else None
