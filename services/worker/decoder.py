"""A lean forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), their
mixture-of-experts kin (Qwen2-MoE, Qwen3-MoE) and DeepSeek-V3/R1.

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

A layer is an attention part and an MLP part, picked per layer from the
config: the Llama family's grouped-query attention or DeepSeek's multi-head
latent attention (mla.py, over a latent KV pool); a dense MLP or an MoE block
(moe.py: routed experts stacked, shared experts) on the layers the family
makes MoE. Under tensor parallelism attention is split by heads (MLA's latent
is cached whole on every rank), dense MLPs by rows, and an MoE block by
experts (expert parallelism: each rank runs its experts for every token, and
one all-reduce sums the ranks' parts).

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
from services.worker.kv_cache import MLA_MODEL_TYPES, KVCacheSpec
from services.worker.mla import MlaAttention
from services.worker.moe import MoE, ExpertShard
from services.worker.parallel import TensorParallel, balanced_range
from services.worker.quantization import linear_weight
from services.worker.platforms import LayerOps, Linear, Platform
from services.worker.rotary import STATIC_ROPE_TYPES, Rotary, StepRope, rope_parameters

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3")
class GqaAttention:
    """The Llama family's attention: Q/K/V in one matmul (biases where the
    checkpoint has them), Qwen3's per-head q/k norms, rotary, paged attention.
    Called on the normed hidden states; o_proj is the caller's (the last layer
    applies it to the rows that get logits only)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, index: int, config, backend: Platform,
                 num_heads: int, num_kv_heads: int, head_dim: int, rotary: Rotary, row_parallel, ops: LayerOps):
        self.index, self.num_heads, self.num_kv_heads, self.head_dim = index, num_heads, num_kv_heads, head_dim
        self.ops = ops
        self.eps, self.scaling, self.rotary = config.rms_norm_eps, head_dim ** -0.5, rotary
        projections = [prefix + name for name in ("q_proj", "k_proj", "v_proj")]
        bias = None
        if projections[0] + ".bias" in weights:
            bias = torch.cat([weights[p + ".bias"] for p in projections])
        self.qkv = backend.linear(linear_weight(weights, projections), bias)
        # Qwen3: RMSNorm weights per head, [heads + kv_heads, head_dim].
        self.qk_norm = None
        if prefix + "q_norm.weight" in weights:
            self.qk_norm = torch.cat([weights[prefix + "q_norm.weight"].expand(num_heads, -1),
                                      weights[prefix + "k_norm.weight"].expand(num_kv_heads, -1)])
        self.o_proj = row_parallel(backend.linear(linear_weight(weights, [prefix + "o_proj"]),
                                                  weights.get(prefix + "o_proj.bias")))
        self.sliding_window = None
        layer_types = getattr(config, "layer_types", None)
        if config.model_type == "mistral" or (layer_types and layer_types[index] == "sliding_attention"):
            self.sliding_window = getattr(config, "sliding_window", None)

    def __call__(self, h: torch.Tensor, step: PagedStep, rope: StepRope) -> torch.Tensor:
        """h [T, hidden] -> the heads' output [T, heads * head_dim], before o_proj."""
        num_q, num_kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(h)
        # Q and K heads side by side: one norm and one rotation for both.
        qk = qkv[:, : num_q + num_kv].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, qk.shape[-1:], eps=self.eps) * self.qk_norm
        cos, sin = rope(self.rotary)
        q, k = self.ops.rotate(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, num_q + num_kv :].view(-1, self.num_kv_heads, self.head_dim)
        o = paged_attention(q, k, v, self.index, step, self.scaling, self.sliding_window)
        return o.view(-1, num_q)


class DenseMlp:
    """gate and up in one matmul, SiLU-times-up, down with the residual fused in."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str, backend: Platform, row_parallel,
                 ops: LayerOps):
        self.gate_up = backend.linear(linear_weight(weights, [prefix + "gate_proj", prefix + "up_proj"]), None)
        self.down = row_parallel(backend.linear(linear_weight(weights, [prefix + "down_proj"]), None))
        self.silu_mul = ops.silu_mul

    def __call__(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.down(self.silu_mul(self.gate_up(h)), residual=residual)


class MoeMlp:
    """An MoE block with the residual; under expert parallelism each rank's part
    (its experts, and the shared experts on one rank) summed over the ranks."""

    def __init__(self, moe: MoE, all_reduce):
        self.moe, self.all_reduce = moe, all_reduce

    def __call__(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.moe(h)
        return residual + (out if self.all_reduce is None else self.all_reduce(out))


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    attention: GqaAttention | MlaAttention
    post_attention_norm: torch.Tensor
    mlp: DenseMlp | MoeMlp


@dataclass(frozen=True)
class _MtpModule:
    """DeepSeek's multi-token prediction module (model.layers.<num_hidden_layers>):
    the next token's embedding and a position's final hidden state, each
    RMS-normed, joined by eh_proj, through one decoder layer of its own (its KV
    in the pool's layer after the model's), to its norm and the model's lm_head
    (which DeepSeek's shared_head.head repeats)."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear
    layer: _Layer
    norm: torch.Tensor


class LeanDecoder:
    """Logits for a packed step, from the weights of a checkpoint of a supported family."""

    @staticmethod
    def supports(config) -> bool:
        return (
            getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
            and getattr(config, "hidden_act", None) == "silu"
            and not getattr(config, "mlp_bias", False)
            and rope_parameters(config).get("rope_type", "default") in STATIC_ROPE_TYPES
        )

    def __init__(self, config, weights: Mapping[str, torch.Tensor], backend: Platform,
                 tensor_parallel: TensorParallel | None = None, kv_spec: KVCacheSpec | None = None,
                 mtp: bool = False):
        """`weights`: the checkpoint's tensors by name, in the dtype and on the
        device to run (a Checkpoint, or a loaded model's state_dict).
        `tensor_parallel`: this rank's group; it runs its shard (parallel.py).
        `kv_spec`: the pool's (an MLA model's platform ops are made for it).
        `mtp`: load the checkpoint's MTP module too (`draft_logits`)."""
        num_heads: int = config.num_attention_heads
        num_kv_heads: int = config.num_key_value_heads or num_heads
        self.eps: float = config.rms_norm_eps
        head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.vocab_size: int = config.vocab_size
        self.tp = tensor_parallel
        mla = config.model_type in MLA_MODEL_TYPES
        intermediate_size = config.intermediate_size
        whole = weights  # MLA and MoE take their own shares of the whole tensors
        head_shard = experts = None
        if tensor_parallel is not None:
            weights = tensor_parallel.shard_weights(weights, config)
            head_shard = weights.heads
            num_heads, num_kv_heads = head_shard.num_heads, head_shard.num_kv_heads
            intermediate_size = weights.mlp_rows[1] - weights.mlp_rows[0]
            num_experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", 0)
            if num_experts:
                first, end = balanced_range(num_experts, tensor_parallel.world_size, tensor_parallel.rank)
                experts = ExpertShard(first, end - first)
        row_parallel = (lambda linear: linear) if tensor_parallel is None else tensor_parallel.row_parallel
        all_reduce = None if tensor_parallel is None else tensor_parallel.all_reduce
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        lm_head = weights.get("lm_head.weight")
        self.lm_head = backend.linear(self.embed if lm_head is None else lm_head, None)
        self.ops = ops = backend.layer_ops(self.embed.dtype, config.hidden_size, intermediate_size,
                                           config.qk_rope_head_dim if mla else head_dim)
        if mla:
            rotary = Rotary(config, config.qk_rope_head_dim)
            spec = kv_spec or KVCacheSpec.from_model_config(config, 16, self.embed.dtype)
            mla_ops = backend.mla_ops(spec, num_heads)
        else:
            rotary = Rotary(config, head_dim)

        def attention(i: int) -> GqaAttention | MlaAttention:
            if mla:
                return MlaAttention(config, whole, i, backend, rotary, mla_ops, head_shard, row_parallel)
            return GqaAttention(weights, f"model.layers.{i}.self_attn.", i, config, backend, num_heads,
                                num_kv_heads, head_dim, rotary, row_parallel, ops)

        def mlp(i: int) -> DenseMlp | MoeMlp:
            if MoE.is_moe_layer(config, i):
                return MoeMlp(MoE(config, whole, f"model.layers.{i}.mlp.", backend, experts), all_reduce)
            return DenseMlp(weights, f"model.layers.{i}.mlp.", backend, row_parallel, ops)

        def layer(i: int) -> _Layer:
            return _Layer(input_norm=weights[f"model.layers.{i}.input_layernorm.weight"], attention=attention(i),
                          post_attention_norm=weights[f"model.layers.{i}.post_attention_layernorm.weight"],
                          mlp=mlp(i))

        self.layers = [layer(i) for i in range(config.num_hidden_layers)]
        self.mtp: _MtpModule | None = None
        if mtp:
            prefix = f"model.layers.{config.num_hidden_layers}."
            if prefix + "eh_proj.weight" not in whole:  # transformers' configs say 1 whatever the files hold
                raise ValueError(f"speculative_method mtp needs the checkpoint's multi-token prediction module, "
                                 f"and it has no {prefix}eh_proj.weight")
            self.mtp = _MtpModule(
                enorm=whole[prefix + "enorm.weight"], hnorm=whole[prefix + "hnorm.weight"],
                eh_proj=backend.linear(whole[prefix + "eh_proj.weight"], None), layer=layer(config.num_hidden_layers),
                norm=whole[prefix + "shared_head.norm.weight"])

    def __call__(self, input_ids: torch.Tensor, step: PagedStep, logit_rows: torch.Tensor,
                 keep_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] packed as `step` lays them out; logits [len(logit_rows), vocab].
        `keep_hidden`: also every row's final hidden state [T, hidden], after the
        final norm (what the MTP module reads, as vLLM and SGLang feed it)."""
        x = self._embed(input_ids)  # [T, hidden]
        rope = StepRope(step.positions, x.dtype)
        last_layer = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            # The last layer's K/V are in the cache once its attention ran, and only
            # the rows that get logits read the rest: a prefill chunk skips its
            # o_proj and MLP (unless every row's hidden state is wanted).
            x = self._layer(layer, x, step, rope, logit_rows if index == last_layer and not keep_hidden else None)
        x = self.ops.rms_norm(x, self.final_norm, self.eps)
        if keep_hidden:
            return self._logits(x.index_select(0, logit_rows)), x
        return self._logits(x)

    def draft_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, step: PagedStep,
                     logit_rows: torch.Tensor) -> torch.Tensor:
        """The MTP module over positions whose final hidden states are `hidden` [T,
        hidden] and whose next tokens are `next_ids` [T], laid out as `step` (the
        pool's MTP layer): logits [len(logit_rows), vocab] for the token after the next."""
        mtp, ops = self.mtp, self.ops
        assert mtp is not None
        e = ops.rms_norm(self._embed(next_ids), mtp.enorm, self.eps)
        x = mtp.eh_proj(torch.cat([e, ops.rms_norm(hidden, mtp.hnorm, self.eps)], dim=-1))
        x = self._layer(mtp.layer, x, step, StepRope(step.positions, x.dtype), logit_rows)
        return self._logits(self.ops.rms_norm(x, mtp.norm, self.eps))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed[input_ids]
        return self.tp.embed(self.embed.__getitem__, self.embed.shape[0], input_ids)

    def _layer(self, layer: _Layer, x: torch.Tensor, step: PagedStep, rope: StepRope,
               rows: torch.Tensor | None) -> torch.Tensor:
        """One decoder layer with its residuals; past attention only `rows` (all when None)."""
        ops = self.ops
        o = layer.attention(ops.rms_norm(x, layer.input_norm, self.eps), step, rope)
        if rows is not None:
            o, x = o.index_select(0, rows), x.index_select(0, rows)
        x = layer.attention.o_proj(o, residual=x)
        return layer.mlp(ops.rms_norm(x, layer.post_attention_norm, self.eps), x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over normed hidden states."""
        logits = self.lm_head(x)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.vocab_size)
