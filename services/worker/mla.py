"""Multi-head Latent Attention (DeepSeek-V3/R1) over the latent paged cache.

The math is transformers' DeepseekV3Attention. Per token the layer makes a
query per head (q_a_proj -> q_a_layernorm -> q_b_proj, or q_proj) of
qk_nope + qk_rope values, and one shared latent: kv_a_proj_with_mqa gives
kv_lora_rank values, RMS-normed into c_kv, and qk_rope values rotated into
k_pe. Only c_kv and k_pe are cached (kv_cache.py: 576 values per token and
layer for DeepSeek-V3, where K/V per head would take 128 x 320); kv_b_proj
turns c_kv into every head's nope key and value.

- Decode (sequences with one new token) is absorbed, as vLLM's MLA backend
  and DeepSeek's inference code run it: q_nope . W_UK (kv_b_proj's key rows)
  puts each head's query in latent space, where one MQA over [c_kv | k_pe]
  of the context (all decodes of the step in one batched call) attends with
  c_kv as the value; the latent output . W_UV (kv_b_proj's value rows) gives
  the head's output. No per-head K/V is ever made: a step reads 576 values per
  context token instead of projecting each to 128 x 256.
- Prefill chunks, cached prefix or not, and the drafted rows of speculative
  decoding (a sequence with several new tokens) are expanded: kv_b_proj turns
  the context's latent into per-head K (nope | rope) and V, and SDPA attends
  causally within the chunk and over its prefix, as attention.py does. Over
  many new rows the expansion is the cheaper form.

The rope is DeepSeek's interleaved one (pairs of adjacent values), whose output
transformers lays out as the rotate-half form's: checkpoints with
rope_interleave false get their rope rows permuted at load so that the same
interleaved rotation (and Ascend's fused ops, which do only that one) gives
their rotate-half result, value for value.

The per-step work behind MlaOps is the platform's: the torch reference here
(CPU, and CUDA, where no fused MLA kernel is wired), Ascend's fused cache
write and MLA decode on NPU (platforms/npu.py).

Use: a pool from KVCacheSpec.from_model_config (the latent layout), steps from
build_paged_step without an attention kernel (MLA reads the SDPA layout), one
Rotary over qk_rope_head_dim and one Platform.mla_ops(spec, heads) shared by every layer, and
o_proj applied by the caller to the heads' output, as for decoder.GqaAttention.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.attention import DecodeBatch, PagedStep, PrefillChunk, _gather, _prefill_mask
from services.worker.kv_cache import MLA_MODEL_TYPES
from services.worker.parallel import HeadShard
from services.worker.platforms import Linear, Platform, TorchLayerOps
from services.worker.rotary import Rotary, rope_parameters

# RoPE variants of DeepSeek-V3/R1 checkpoints.
MLA_ROPE_TYPES = ("default", "yarn")


def softmax_scale(config) -> float:
    """transformers' yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5): yarn's
    mscale_all_dim enters the softmax scale squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    parameters = rope_parameters(config)
    mscale_all_dim = parameters.get("mscale_all_dim", 0)
    if parameters.get("rope_type", "default") != "default" and mscale_all_dim and parameters["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(parameters["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope_dim] with rotated pairs adjacent, cos and sin [T, rope_dim]:
    transformers' apply_rotary_pos_emb_interleave (its output in rotate-half layout)."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MlaOps(Protocol):
    """A platform's MLA steps over one layer of the latent pool."""

    def write_latent(self, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv [T, kv_lora_rank + rope_dim] from kv_a_proj_with_mqa: RMS-norm the
        latent, rotate the rope key, write both at `slot_mapping` [T] into the
        layer's caches [num_slots, kv_lora_rank] and [num_slots, rope_dim];
        returns them (c_kv [T, kv_lora_rank], k_pe [T, rope_dim])."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The query's rope part x [T, heads, rope_dim], rotated as the key is."""

    def decode(self, q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
               rope_cache: torch.Tensor, decode: DecodeBatch, scale: float) -> torch.Tensor:
        """The step's decodes, absorbed: queries [B, heads, kv_lora_rank] and
        [B, heads, rope_dim] over each one's cached context -> the latent output
        [heads, B, kv_lora_rank] (head-major, as the W_UV product takes it)."""


class TorchMlaOps:
    """MLA in torch ops: CPU, CUDA, and the reference the fused ops are tested against."""

    def write_latent(self, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rank = latent_cache.shape[-1]
        c_kv = TorchLayerOps.rms_norm(kv[:, :rank], norm_weight, eps)
        k_pe = rotate_interleaved(kv[:, None, rank:], cos, sin)[:, 0]
        latent_cache.index_copy_(0, slot_mapping, c_kv)
        rope_cache.index_copy_(0, slot_mapping, k_pe)
        return c_kv, k_pe

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos, sin)

    def decode(self, q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
               rope_cache: torch.Tensor, decode: DecodeBatch, scale: float) -> torch.Tensor:
        c_kv = _gather(latent_cache, decode.context_slots)  # [B, L, kv_lora_rank]: the keys' latent and the values
        k_pe = _gather(rope_cache, decode.context_slots)  # [B, L, rope_dim]
        # Every head of a sequence is a query row of one MQA: [B, heads, L] scores.
        scores = torch.baddbmm(torch.bmm(q_rope, k_pe.transpose(1, 2)), q_latent, c_kv.transpose(1, 2),
                               alpha=scale, beta=scale)
        scores.masked_fill_(~decode.mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(c_kv.dtype)
        return torch.bmm(probs, c_kv).transpose(0, 1)


def _interleave_rows(rope_dim: int) -> torch.Tensor:
    """Row order that gives rotate-half pairs (i, i + rope_dim / 2) the adjacent
    places (2i, 2i + 1) the interleaved rotation pairs."""
    half = rope_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()


class MlaAttention:
    """One layer's MLA, called on the layer's normed hidden states: query and
    latent projections, the latent cache write, attention. o_proj is the
    caller's, as decoder.GqaAttention's is (the last layer applies it to the
    rows that get logits only)."""

    def __init__(self, config, weights: Mapping[str, torch.Tensor], layer: int, platform: Platform,
                 rotary: Rotary | None = None, ops: MlaOps | None = None,
                 head_shard: HeadShard | None = None, row_parallel: Callable[[Linear], Linear] | None = None,
                 absorbed_decode: bool = True):
        """`weights`: the checkpoint's tensors by name (model.layers.{layer}.self_attn.*),
        in the dtype and on the device to run. `rotary`: the model's Rotary over qk_rope_head_dim,
        one for every layer (made here without one). `ops`: Platform.mla_ops of
        the pool, one for every layer (None: TorchMlaOps). `head_shard`: this
        rank's query heads under tensor parallelism (first_head, num_heads; its
        KV fields are not used: the latent is every head's, and every rank caches
        all of it); q_b_proj / q_proj and kv_b_proj keep the shard's heads, o_proj
        its input columns, and only the shard with head 0 adds o_proj's bias.
        `row_parallel` wraps o_proj (TensorParallel.row_parallel: the all-reduce,
        the residual added once). `absorbed_decode` False runs decodes expanded
        as prefills are (the reference the absorbed form is tested and timed against)."""
        if getattr(config, "model_type", None) not in MLA_MODEL_TYPES:
            raise ValueError(f"MLA of {getattr(config, 'model_type', None)!r} models is not supported")
        self.layer = layer
        rope_type = rope_parameters(config).get("rope_type", "default")
        if rope_type not in MLA_ROPE_TYPES:
            raise ValueError(f"MLA: rope_type {rope_type!r} is not supported ({', '.join(MLA_ROPE_TYPES)})")
        self.rotary = Rotary(config, config.qk_rope_head_dim) if rotary is None else rotary
        self.ops: MlaOps = TorchMlaOps() if ops is None else ops
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank: int = config.kv_lora_rank
        self.eps: float = config.rms_norm_eps
        self.scale = softmax_scale(config)
        self.absorbed_decode = absorbed_decode
        total_heads = config.num_attention_heads
        first = 0 if head_shard is None else head_shard.first_head
        self.num_heads: int = total_heads if head_shard is None else head_shard.num_heads
        interleaved = getattr(config, "rope_interleave", True)
        prefix = f"model.layers.{layer}.self_attn."

        def heads(weight: torch.Tensor, per_head: int) -> torch.Tensor:
            """This shard's heads of a [total_heads * per_head, in] weight, as [heads, per_head, in]."""
            shard = weight.reshape(total_heads, per_head, -1)[first : first + self.num_heads]
            # A copy when sharded: a view would keep every rank's rows alive.
            return shard if self.num_heads == total_heads else shard.clone()

        qk_dim = self.nope_dim + self.rope_dim
        q_name = "q_b_proj" if config.q_lora_rank else "q_proj"
        q_weight = heads(weights[prefix + q_name + ".weight"], qk_dim)
        kv_a_weight, kv_a_bias = weights[prefix + "kv_a_proj_with_mqa.weight"], weights.get(
            prefix + "kv_a_proj_with_mqa.bias")
        if not interleaved:
            order = _interleave_rows(self.rope_dim)
            q_weight = torch.cat((q_weight[:, : self.nope_dim], q_weight[:, self.nope_dim :][:, order]), dim=1)
            latent_rows = torch.arange(self.kv_lora_rank)
            kv_order = torch.cat((latent_rows, self.kv_lora_rank + order))
            kv_a_weight = kv_a_weight[kv_order]
            kv_a_bias = None if kv_a_bias is None else kv_a_bias[kv_order]
        self.q_a: Linear | None = None
        self.q_a_norm: torch.Tensor | None = None
        if config.q_lora_rank:
            self.q_a = platform.linear(weights[prefix + "q_a_proj.weight"], weights.get(prefix + "q_a_proj.bias"))
            self.q_a_norm = weights[prefix + "q_a_layernorm.weight"]
        self.q_proj = platform.linear(q_weight.flatten(0, 1), None)
        self.kv_a = platform.linear(kv_a_weight, kv_a_bias)
        self.kv_a_norm = weights[prefix + "kv_a_layernorm.weight"]
        kv_b = heads(weights[prefix + "kv_b_proj.weight"], self.nope_dim + self.v_dim)  # [heads, nope + v, rank]
        self.kv_b = platform.linear(kv_b.flatten(0, 1), None)
        # The absorbed decode's factors, views of kv_b_proj's rows (no second copy
        # of them: 2 GB over DeepSeek-V3's 61 layers in bfloat16).
        self.w_uk = kv_b[:, : self.nope_dim]  # [heads, nope, rank]
        self.w_uv_t = kv_b[:, self.nope_dim :].transpose(1, 2)  # [heads, rank, v]
        o_weight = weights[prefix + "o_proj.weight"]
        o_weight = o_weight.reshape(o_weight.shape[0], total_heads, self.v_dim)[:, first : first + self.num_heads]
        o_proj = platform.linear(o_weight.flatten(1), weights.get(prefix + "o_proj.bias") if first == 0 else None)
        self.o_proj = o_proj if row_parallel is None else row_parallel(o_proj)

    def __call__(self, h: torch.Tensor, step: PagedStep,
                 rope: Callable[[Rotary], tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """h [T, hidden_size], packed as `step` lays rows out (build_paged_step
        without a kernel, over a latent pool) -> the heads' output [T, heads * v_head_dim],
        before o_proj. `rope`: the step's cos and sin of a rotary (decoder.StepRope,
        which makes them once per step); without it they are made here."""
        num_tokens = h.shape[0]
        ops = self.ops
        cos, sin = self.rotary(step.positions, h.dtype) if rope is None else rope(self.rotary)
        if self.q_a is None:
            q = self.q_proj(h)
        else:
            q = self.q_proj(TorchLayerOps.rms_norm(self.q_a(h), self.q_a_norm, self.eps))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split((self.nope_dim, self.rope_dim), dim=-1)
        q_pe = ops.rotate(q_pe, cos, sin)
        latent_cache, rope_cache = step.pool.latent_cache[self.layer], step.pool.rope_cache[self.layer]
        c_kv, k_pe = ops.write_latent(self.kv_a(h), self.kv_a_norm, self.eps, cos, sin, latent_cache, rope_cache,
                                      step.slot_mapping)
        out = h.new_empty(num_tokens, self.num_heads, self.v_dim)
        d = step.decode
        if d is not None:
            q_nope_d, q_pe_d = q_nope.index_select(0, d.rows), q_pe.index_select(0, d.rows)
            if self.absorbed_decode:
                o = self._decode_absorbed(q_nope_d, q_pe_d, latent_cache, rope_cache, d)
            else:
                o = self._decode_expanded(q_nope_d, q_pe_d, latent_cache, rope_cache, d)
            out.index_copy_(0, d.rows, o)
        for chunk in step.prefills:
            out[chunk.start : chunk.end] = self._chunk(q_nope, q_pe, c_kv, k_pe, latent_cache, rope_cache, chunk)
        return out.view(num_tokens, -1)

    def _decode_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         rope_cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
        """q_nope [B, heads, nope], q_pe [B, heads, rope] -> [B, heads, v]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [heads, B, rank]
        o_latent = self.ops.decode(q_latent.transpose(0, 1), q_pe, latent_cache, rope_cache, d, self.scale)
        return torch.bmm(o_latent, self.w_uv_t).transpose(0, 1)

    def _decode_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
                         rope_cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
        k, v = self._expand(_gather(latent_cache, d.context_slots), _gather(rope_cache, d.context_slots))
        q = torch.cat((q_nope, q_pe), dim=-1)[:, :, None, :]  # [B, heads, 1, qk]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=self.scale)[:, :, 0, : self.v_dim]

    def _chunk(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               latent_cache: torch.Tensor, rope_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """One sequence's new rows, causal over its context -> [rows, heads, v]."""
        rows = slice(chunk.start, chunk.end)
        if chunk.context_slots is None:  # no cached prefix: the chunk's own latent is the context
            context, context_rope = c_kv[rows], k_pe[rows]
        else:
            context = _gather(latent_cache, chunk.context_slots)
            context_rope = _gather(rope_cache, chunk.context_slots)
        k, v = self._expand(context, context_rope)  # [heads, L, qk], [heads, L, v]
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)  # [heads, rows, qk]
        mask = _prefill_mask(chunk, context.shape[0], None, q.device)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)
        return o[0, ..., : self.v_dim].transpose(0, 1)

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent [..., L, rank] and rope key [..., L, rope] -> per-head K [..., heads, L,
        nope + rope] and V [..., heads, L, v], V zero-padded to K's width where it is
        narrower (DeepSeek: 128 of 192): SDPA's fused kernels take equal widths
        only, and without them CPU SDPA makes every head's [rows, L] scores at once
        (2.4 times slower and 3 times the memory at 2k tokens, 16 heads). The
        padding's outputs are zeros; callers keep the first v_head_dim."""
        kv = self.kv_b(c_kv.reshape(-1, self.kv_lora_rank)).view(*c_kv.shape[:-1], self.num_heads, -1)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope_dim)), dim=-1)
        if self.v_dim < k.shape[-1]:
            v = F.pad(v, (0, k.shape[-1] - self.v_dim))
        return k.transpose(-3, -2), v.transpose(-3, -2)
