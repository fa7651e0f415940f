"""A lean forward for the Llama family (Llama, Mistral, Qwen2, Qwen3).

The HF modules run a decode step as hundreds of small module calls; at small
batch on CPU that Python overhead costs as much as the matmuls. This path reads
the same weights from the checkpoint (checkpoint.py; transformers' model
classes are never built) and runs the same math with fewer ops: Q/K/V fused
into one matmul, gate/up fused into one, the rotary table computed once per
step, every linear prepared by the backend (on CPU packed for its bfloat16
kernel or for oneDNN, residual adds fused into o_proj and down), and on CPU
one-pass kernels for RMSNorm, rotary and SiLU-times-up (the platform's
layer_ops: cpu_kernels.LayerOps, Ascend's fused ops, TorchLayerOps elsewhere).
Attention is the same paged attention the HF path
uses (attention.paged_attention).

Models of other families, and RoPE variants whose frequencies change with the
sequence length (dynamic NTK, LongRoPE), keep running through the HF modules
(model_runner falls back when `LeanDecoder.supports` says no); the unit tests
check both paths against stock HF logits.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.attention import PagedStep, paged_attention
from services.worker.parallel import TensorParallel
from services.worker.platforms import Linear, Platform

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants with fixed frequencies (transformers' names).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}


class Rotary:
    """cos and sin of the rotary embedding at given positions, as transformers'
    Llama-family rotary modules compute them for the static RoPE variants."""

    def __init__(self, config, head_dim: int):
        parameters = _rope_parameters(config)
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
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
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


class GqaAttention:
    """The Llama family's attention: Q/K/V in one matmul (biases where the
    checkpoint has them), Qwen3's per-head q/k norms, rotary, paged attention.
    Called on the normed hidden states; o_proj is the caller's (the last layer
    applies it to the rows that get logits only)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, index: int, config, backend: Platform,
                 num_heads: int, num_kv_heads: int, head_dim: int, rotary: Rotary, row_parallel):
        self.index, self.num_heads, self.num_kv_heads, self.head_dim = index, num_heads, num_kv_heads, head_dim
        self.eps, self.scaling, self.rotary = config.rms_norm_eps, head_dim ** -0.5, rotary
        projections = [prefix + name for name in ("q_proj", "k_proj", "v_proj")]
        bias = None
        if projections[0] + ".bias" in weights:
            bias = torch.cat([weights[p + ".bias"] for p in projections])
        self.qkv = backend.linear(torch.cat([weights[p + ".weight"] for p in projections]), bias)
        # Qwen3: RMSNorm weights per head, [heads + kv_heads, head_dim].
        self.qk_norm = None
        if prefix + "q_norm.weight" in weights:
            self.qk_norm = torch.cat([weights[prefix + "q_norm.weight"].expand(num_heads, -1),
                                      weights[prefix + "k_norm.weight"].expand(num_kv_heads, -1)])
        self.o_proj = row_parallel(backend.linear(weights[prefix + "o_proj.weight"], weights.get(prefix + "o_proj.bias")))
        self.sliding_window = None
        layer_types = getattr(config, "layer_types", None)
        if config.model_type == "mistral" or (layer_types and layer_types[index] == "sliding_attention"):
            self.sliding_window = getattr(config, "sliding_window", None)

    def __call__(self, h: torch.Tensor, step: PagedStep, ops, rope: StepRope) -> torch.Tensor:
        """h [T, hidden] -> the heads' output [T, heads * head_dim], before o_proj."""
        num_q, num_kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(h)
        # Q and K heads side by side: one norm and one rotation for both.
        qk = qkv[:, : num_q + num_kv].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, qk.shape[-1:], eps=self.eps) * self.qk_norm
        cos, sin = rope(self.rotary)
        q, k = ops.rotate(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, num_q + num_kv :].view(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, self.index, step, self.scaling, self.sliding_window)
        return o.view(-1, num_q)


class DenseMlp:
    """gate and up in one matmul, SiLU-times-up, down with the residual fused in."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, backend: Platform, row_parallel):
        self.gate_up = backend.linear(torch.cat([weights[prefix + "gate_proj.weight"],
                                                 weights[prefix + "up_proj.weight"]]), None)
        self.down = row_parallel(backend.linear(weights[prefix + "down_proj.weight"], None))

    def __call__(self, h: torch.Tensor, residual: torch.Tensor, ops) -> torch.Tensor:
        return self.down(ops.silu_mul(self.gate_up(h)), residual=residual)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    attention: GqaAttention
    post_attention_norm: torch.Tensor
    mlp: DenseMlp


class LeanDecoder:
    """Logits for a packed step, from the weights of a checkpoint of a supported family."""

    @staticmethod
    def supports(config) -> bool:
        return (
            getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
            and getattr(config, "hidden_act", None) == "silu"
            and not getattr(config, "mlp_bias", False)
            and _rope_parameters(config).get("rope_type", "default") in STATIC_ROPE_TYPES
        )

    def __init__(self, config, weights: Mapping[str, torch.Tensor], backend: Platform,
                 tensor_parallel: TensorParallel | None = None):
        """`weights`: the checkpoint's tensors by name, in the dtype and on the
        device to run (a Checkpoint, or a loaded model's state_dict).
        `tensor_parallel`: this rank's group; it runs its shard (parallel.py)."""
        num_heads: int = config.num_attention_heads
        num_kv_heads: int = config.num_key_value_heads or num_heads
        self.eps: float = config.rms_norm_eps
        head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.vocab_size: int = config.vocab_size
        self.tp = tensor_parallel
        intermediate_size = config.intermediate_size
        if tensor_parallel is not None:
            weights = tensor_parallel.shard_weights(weights, config)
            num_heads, num_kv_heads = weights.heads.num_heads, weights.heads.num_kv_heads
            intermediate_size = weights.mlp_rows[1] - weights.mlp_rows[0]
        row_parallel = (lambda linear: linear) if tensor_parallel is None else tensor_parallel.row_parallel
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        lm_head = weights.get("lm_head.weight")
        self.lm_head = backend.linear(self.embed if lm_head is None else lm_head, None)
        rotary = Rotary(config, head_dim)
        self.layers = [
            _Layer(
                input_norm=weights[f"model.layers.{i}.input_layernorm.weight"],
                attention=GqaAttention(weights, f"model.layers.{i}.self_attn.", i, config, backend, num_heads,
                                       num_kv_heads, head_dim, rotary, row_parallel),
                post_attention_norm=weights[f"model.layers.{i}.post_attention_layernorm.weight"],
                mlp=DenseMlp(weights, f"model.layers.{i}.mlp.", backend, row_parallel),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.ops = backend.layer_ops(self.embed.dtype, config.hidden_size, intermediate_size, head_dim)

    def __call__(self, input_ids: torch.Tensor, step: PagedStep, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] packed as `step` lays them out; logits [len(logit_rows), vocab]."""
        x = (self.embed[input_ids] if self.tp is None  # [T, hidden]
             else self.tp.embed(self.embed.__getitem__, self.embed.shape[0], input_ids))
        rope = StepRope(step.positions, x.dtype)
        ops = self.ops
        last_layer = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            o = layer.attention(ops.rms_norm(x, layer.input_norm, self.eps), step, ops, rope)
            if index == last_layer:
                # Its K/V are in the cache now, and only the rows that get logits
                # read the rest: a prefill chunk skips the last o_proj and MLP.
                o, x = o.index_select(0, logit_rows), x.index_select(0, logit_rows)
            x = layer.attention.o_proj(o, residual=x)
            x = layer.mlp(ops.rms_norm(x, layer.post_attention_norm, self.eps), x, ops)
        logits = self.lm_head(ops.rms_norm(x, self.final_norm, self.eps))
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.vocab_size)
