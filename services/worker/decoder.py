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


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    qk_norm: torch.Tensor | None  # Qwen3: RMSNorm weights per head, [heads + kv_heads, head_dim]
    o_proj: Linear
    post_attention_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    sliding_window: int | None


class LeanDecoder:
    """Logits for a packed step, from the weights of a Llama-family checkpoint."""

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
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or self.num_heads
        self.eps: float = config.rms_norm_eps
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling: float = self.head_dim ** -0.5
        self.vocab_size: int = config.vocab_size
        self.tp = tensor_parallel
        intermediate_size = config.intermediate_size
        if tensor_parallel is not None:
            weights = tensor_parallel.shard_weights(weights, config)
            self.num_heads, self.num_kv_heads = weights.heads.num_heads, weights.heads.num_kv_heads
            intermediate_size = weights.mlp_rows[1] - weights.mlp_rows[0]
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        lm_head = weights.get("lm_head.weight")
        self.lm_head = backend.linear(self.embed if lm_head is None else lm_head, None)
        self.rotary = Rotary(config, self.head_dim)
        self.layers = [self._layer(weights, f"model.layers.{i}.", i, config, backend)
                       for i in range(config.num_hidden_layers)]
        self.ops = backend.layer_ops(self.embed.dtype, config.hidden_size, intermediate_size, self.head_dim)

    def _layer(self, weights: Mapping[str, torch.Tensor], prefix: str, index: int, config,
               backend: Platform) -> _Layer:
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        projections = [attn + name for name in ("q_proj", "k_proj", "v_proj")]
        qkv_bias = None
        if projections[0] + ".bias" in weights:
            qkv_bias = torch.cat([weights[p + ".bias"] for p in projections])
        qk_norm = None
        if attn + "q_norm.weight" in weights:
            qk_norm = torch.cat([weights[attn + "q_norm.weight"].expand(self.num_heads, -1),
                                 weights[attn + "k_norm.weight"].expand(self.num_kv_heads, -1)])
        row_parallel = (lambda linear: linear) if self.tp is None else self.tp.row_parallel
        window = None
        layer_types = getattr(config, "layer_types", None)
        if config.model_type == "mistral" or (layer_types and layer_types[index] == "sliding_attention"):
            window = getattr(config, "sliding_window", None)
        return _Layer(
            input_norm=weights[prefix + "input_layernorm.weight"],
            qkv=backend.linear(torch.cat([weights[p + ".weight"] for p in projections]), qkv_bias),
            qk_norm=qk_norm,
            o_proj=row_parallel(backend.linear(weights[attn + "o_proj.weight"], weights.get(attn + "o_proj.bias"))),
            post_attention_norm=weights[prefix + "post_attention_layernorm.weight"],
            gate_up=backend.linear(torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]),
                                   None),
            down=row_parallel(backend.linear(weights[mlp + "down_proj.weight"], None)),
            sliding_window=window,
        )

    def __call__(self, input_ids: torch.Tensor, step: PagedStep, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] packed as `step` lays them out; logits [len(logit_rows), vocab]."""
        x = (self.embed[input_ids] if self.tp is None  # [T, hidden]
             else self.tp.embed(self.embed.__getitem__, self.embed.shape[0], input_ids))
        cos, sin = self.rotary(step.positions, x.dtype)  # [T, head_dim]
        ops = self.ops
        num_q = self.num_heads * self.head_dim
        num_kv = self.num_kv_heads * self.head_dim
        last_layer = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, self.eps))
            # Q and K heads side by side: one norm and one rotation for both.
            qk = qkv[:, : num_q + num_kv].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, qk.shape[-1:], eps=self.eps) * layer.qk_norm
            q, k = ops.rotate(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
            v = qkv[:, num_q + num_kv :].view(-1, self.num_kv_heads, self.head_dim)
            o = paged_attention(q, k, v, index, step, self.scaling, layer.sliding_window)
            if index == last_layer:
                # Its K/V are in the cache now, and only the rows that get logits
                # read the rest: a prefill chunk skips the last o_proj and MLP.
                o, x = o.index_select(0, logit_rows), x.index_select(0, logit_rows)
            x = layer.o_proj(o.view(-1, num_q), residual=x)
            h = ops.rms_norm(x, layer.post_attention_norm, self.eps)
            x = layer.down(ops.silu_mul(layer.gate_up(h)), residual=x)
        logits = self.lm_head(ops.rms_norm(x, self.final_norm, self.eps))
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.vocab_size)
