"""Rotary position tables: cos and sin at a step's positions, as transformers'
rotary modules compute them for the RoPE variants whose frequencies do not
change with the sequence (the Llama family's over head_dim; DeepSeek's over
qk_rope_head_dim, yarn's attention scaling included)."""
from __future__ import annotations

import torch

# RoPE variants with fixed frequencies (transformers' names).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}


class Rotary:
    """cos and sin of the rotary embedding over `head_dim` at given positions."""

    def __init__(self, config, head_dim: int):
        parameters = rope_parameters(config)
        rope_type = parameters.get("rope_type", "default")
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            self.inv_freq = 1.0 / (parameters["rope_theta"] ** exponents)
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim]."""
        if self.inv_freq.device != positions.device:  # moved once: no copy inside a captured graph
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)


class StepRope:
    """cos and sin of one step's positions, computed once per rotary table and
    shared by every layer that uses it."""

    def __init__(self, positions: torch.Tensor, dtype: torch.dtype):
        self.positions, self.dtype = positions, dtype
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(id(rotary))
        if table is None:
            table = self._tables[id(rotary)] = rotary(self.positions, self.dtype)
        return table
