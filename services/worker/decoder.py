"""A lean forward for the Llama family (Llama, Mistral, Qwen2, Qwen3).

The HF modules run a decode step as hundreds of small module calls; at small
batch on CPU that Python overhead costs as much as the matmuls. This path takes
the same weights out of the loaded HF model and runs the same math with fewer
ops: Q/K/V fused into one matmul, gate/up fused into one, the rotary table
computed once per step, every linear prepared by the backend (prepacked for
oneDNN on CPU bfloat16, residual adds fused into o_proj and down), and on CPU
one-pass kernels for RMSNorm, rotary and SiLU-times-up (cpu_kernels.LayerOps;
TorchLayerOps elsewhere). Attention is the same paged attention the HF path
uses (attention.paged_attention).

Models of other families keep running through the HF modules (model_runner
falls back when `LeanDecoder.supports` says no); the unit tests check both
paths against stock HF logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.worker.attention import PagedStep, paged_attention
from services.worker.backend import Backend, Linear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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


class TorchLayerOps:
    """RMSNorm, rotary embedding and SiLU-times-up in torch ops: on devices without
    fused kernels, and the reference cpu_kernels.LayerOps is tested against."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Accumulates in float32 and rounds once; HF rounds once more in bfloat16.
        return F.rms_norm(x, x.shape[-1:], weight, eps=eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, head_dim], cos and sin [rows, head_dim]; the rotated
        heads (a new tensor here; the CPU kernel rotates x in place)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


class LeanDecoder:
    """Logits for a packed step, from the weights of a loaded HF Llama-family model."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = model.config
        return (
            getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
            and getattr(config, "hidden_act", None) == "silu"
            and not getattr(config, "mlp_bias", False)
        )

    def __init__(self, model: torch.nn.Module, backend: Backend):
        config = model.config
        base = model.model
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or self.num_heads
        self.eps: float = config.rms_norm_eps
        self.embed = base.embed_tokens.weight
        self.rotary = base.rotary_emb
        self.final_norm = base.norm.weight
        self.lm_head = backend.linear(model.lm_head.weight, None)
        first = base.layers[0].self_attn
        self.head_dim: int = first.head_dim
        self.scaling: float = first.scaling
        self.layers = [self._layer(layer, config, backend) for layer in base.layers]
        self.ops = backend.layer_ops(
            self.embed.dtype, config.hidden_size, config.intermediate_size, self.head_dim
        ) or TorchLayerOps()

    @staticmethod
    def _layer(layer: torch.nn.Module, config, backend: Backend) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([p.bias for p in projections])
        qk_norm = None
        if hasattr(attn, "q_norm"):
            heads = attn.q_proj.weight.shape[0] // attn.head_dim
            kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
            qk_norm = torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)])
        window = getattr(attn, "sliding_window", None)
        if config.model_type == "mistral":  # one window for every layer, read from the config
            window = getattr(config, "sliding_window", None)
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            qkv=backend.linear(torch.cat([p.weight for p in projections]), qkv_bias),
            qk_norm=qk_norm,
            o_proj=backend.linear(attn.o_proj.weight, attn.o_proj.bias),
            post_attention_norm=layer.post_attention_layernorm.weight,
            gate_up=backend.linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None),
            down=backend.linear(mlp.down_proj.weight, None),
            sliding_window=window,
        )

    def __call__(self, input_ids: torch.Tensor, step: PagedStep, logit_rows: torch.Tensor) -> torch.Tensor:
        """input_ids [T] packed as `step` lays them out; logits [len(logit_rows), vocab]."""
        x = self.embed[input_ids]  # [T, hidden]
        cos, sin = self.rotary(x, step.positions[None])
        cos, sin = cos[0], sin[0]  # [T, head_dim]
        ops = self.ops
        num_q = self.num_heads * self.head_dim
        num_kv = self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, self.eps))
            # Q and K heads side by side: one norm and one rotation for both.
            qk = qkv[:, : num_q + num_kv].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, qk.shape[-1:], eps=self.eps) * layer.qk_norm
            q, k = ops.rotate(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
            v = qkv[:, num_q + num_kv :].view(-1, self.num_kv_heads, self.head_dim)
            o = paged_attention(q, k, v, index, step, self.scaling, layer.sliding_window)
            x = layer.o_proj(o.view(-1, num_q), residual=x)
            h = ops.rms_norm(x, layer.post_attention_norm, self.eps)
            x = layer.down(ops.silu_mul(layer.gate_up(h)), residual=x)
        last = ops.rms_norm(x.index_select(0, logit_rows), self.final_norm, self.eps)
        return self.lm_head(last)
