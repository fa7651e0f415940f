"""A torch_npu for tests on CPU: each op the worker's NPU platform calls
(services/worker/platforms/npu.py), registered with torch's dispatcher as
torch.ops.npu.<op> under the real op's schema (copied from op-plugin's
op_plugin/config/op_plugin_functions.yaml, the schemas of torch_npu 26.0.0
and later), so a wrong keyword name, a missing argument or one passed the
wrong way fails here as it would on the device. Each is a reference
implementation with the real op's layouts and result tuple, refusing what
the real op would not take the way our code could get wrong (a layout, a
cache mode, an index dtype, a mask), and modelling what the real op's
documentation says it ignores. Never a model of speed or of the kernels'
rounding: it computes in float32 and rounds once.

Importing it also installs `torch.npu` (the device namespace torch_npu
registers) as far as the platform uses it, graph capture and replay
included (_graphs.py). Tensors stay on the CPU, and
torch.npu.is_available() is False: no device is there, and transformers'
own NPU integrations (which this module does not model) stay off; tests
build the NPU platform directly. The ops stay registered for the rest of
the process: import it once (a second import after removing it from
sys.modules would register them twice).
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

_INT32_MAX = 2147483647

SCHEMAS = {
    "npu_scatter_pa_kv_cache": (
        "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, Tensor? "
        "seq_lens=None, str? cache_mode='PA_NZ') -> ()"
    ),
    "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
        "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, "
        "Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, Tensor? "
        "quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, Tensor? "
        "antiquant_offset=None, Tensor? key_antiquant_scale=None, Tensor? key_antiquant_offset=None, Tensor? "
        "value_antiquant_scale=None, Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? "
        "query_padding_size=None, Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? "
        "value_shared_prefix=None, SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? "
        "key_rope=None, Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, int "
        "pre_tokens=2147483647, int next_tokens=2147483647, str input_layout=\"BSH\", int "
        "num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, int "
        "antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, bool softmax_lse_flag=False)"
        " -> (Tensor, Tensor)"
    ),
    "npu_rms_norm": (
        "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)"
    ),
    "npu_swiglu": (
        "npu_swiglu(Tensor self, int dim=-1) -> Tensor"
    ),
    "npu_rotary_mul": (
        "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> "
        "Tensor"
    ),
}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"torch_npu reference: {message}")


def _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, compress_lens=None,
                         compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    """Writes key/value [T, kv_heads, head_dim] at slot_mapping [T] (slot =
    block * block_size + offset) into caches (num_blocks, block_size, kv_heads,
    head_dim): cache_mode "Norm" only (PA_NZ, the default, is a fractal layout)."""
    _check(cache_mode == "Norm", f"cache_mode {cache_mode!r}: the reference lays out 'Norm' only")
    _check(compress_lens is None and compress_seq_offsets is None and seq_lens is None, "compression unsupported")
    _check(key.dim() == 3 and key_cache.dim() == 4, "key [T, N, D] and key_cache [blocks, block_size, N, D]")
    _check(key.is_contiguous() and value.is_contiguous(), "non-contiguous key/value")
    _check(key_cache.shape[2:] == key.shape[1:] and value_cache.shape[2:] == value.shape[1:],
           f"cache heads/dims {tuple(key_cache.shape)} do not match key {tuple(key.shape)}")
    _check(slot_mapping.dtype == torch.int32 and slot_mapping.shape == key.shape[:1], "slot_mapping int32 [T]")
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    key_cache[slots // block_size, slots % block_size] = key
    value_cache[slots // block_size, slots % block_size] = value


_ATTENTION_DEFAULTS = {argument.name: argument.default_value
                       for argument in torch._C.parse_schema(SCHEMAS["npu_fused_infer_attention_score"]).arguments
                       if argument.kwarg_only}
_ATTENTION_MODELLED = ("atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads", "scale",
                       "pre_tokens", "next_tokens", "input_layout", "num_key_value_heads", "sparse_mode",
                       "inner_precise", "block_size", "softmax_lse_flag")


def _fused_infer_attention_score(query, key, value, **kwargs):
    """The paged TND case: query [T, N, D]; key/value (num_blocks, block_size,
    kv_heads * D) read through block_table [B, max_blocks] int32;
    actual_seq_lengths the cumulative query ends, actual_seq_lengths_kv each
    sequence's KV length; sparse_mode 3 (causal, aligned to the bottom right
    of each [q, kv] block) or 4 (a band of pre_tokens / next_tokens around
    that diagonal), both with the compressed 2048 x 2048 upper-triangular
    mask. With one query token per sequence (Q_S = 1, the op's decode
    branch) the documentation has sparse_mode, pre_tokens and next_tokens
    "invalid": every one of a sequence's KV tokens is attended, band or not.
    Returns (attention_out [T, N, D], softmax_lse [T, N, 1], or [1] of 0
    without softmax_lse_flag)."""
    unmodelled = {name: v for name, v in kwargs.items() if name not in _ATTENTION_MODELLED}
    _check(all(v == _ATTENTION_DEFAULTS[name] for name, v in unmodelled.items()),
           f"arguments the reference does not model: {sorted(unmodelled)}")
    arguments = {name: kwargs.get(name, _ATTENTION_DEFAULTS[name]) for name in _ATTENTION_MODELLED}
    num_heads, block_size, block_table = arguments["num_heads"], arguments["block_size"], arguments["block_table"]
    _check(arguments["input_layout"] == "TND" and block_table is not None, "the reference models paged TND only")
    _check(query.dim() == 3 and query.shape[1] == num_heads, f"query [T, {num_heads}, D], got {tuple(query.shape)}")
    kv_heads = arguments["num_key_value_heads"] or num_heads
    head_dim = query.shape[2]
    _check(key.dim() == 3 and key.shape[1] == block_size and key.shape[2] == kv_heads * head_dim,
           f"key ({'{blocks}'}, {block_size}, {kv_heads * head_dim}), got {tuple(key.shape)}")
    _check(block_table.dtype == torch.int32, "block_table int32")
    sparse_mode = arguments["sparse_mode"]
    _check(sparse_mode in (3, 4), f"sparse_mode {sparse_mode}: the reference models 3 and 4")
    causal = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)
    mask = arguments["atten_mask"]
    _check(mask is not None and mask.dtype in (torch.int8, torch.bool, torch.uint8)
           and torch.equal(mask.to(torch.int8).cpu(), causal), "sparse_mode 3/4 take the 2048^2 triu mask")
    ends = list(arguments["actual_seq_lengths"])
    kv_lens = list(arguments["actual_seq_lengths_kv"])
    _check(len(ends) == len(kv_lens) == block_table.shape[0] and ends[-1] == query.shape[0],
           "actual_seq_lengths must be cumulative query ends, one per block-table row")
    pre_tokens, next_tokens = arguments["pre_tokens"], arguments["next_tokens"]
    if sparse_mode == 3:
        pre_tokens, next_tokens = _INT32_MAX, 0
    if max(end - start for start, end in zip([0, *ends], ends)) == 1:  # Q_S = 1: no band
        pre_tokens, next_tokens = _INT32_MAX, _INT32_MAX
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[0], num_heads, 1, dtype=torch.float32)
    start = 0
    for row, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        n = end - start
        _check(0 < n <= kv_len <= block_table.shape[1] * block_size, "query longer than its KV, or KV past the table")
        blocks = block_table[row, : -(-kv_len // block_size)].long()
        k = key[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        v = value[blocks].reshape(-1, kv_heads, head_dim)[:kv_len].float()
        k, v = (t.repeat_interleave(num_heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), k) * arguments["scale"]
        q_pos = torch.arange(kv_len - n, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        allowed = (k_pos <= q_pos + next_tokens) & (k_pos >= q_pos - pre_tokens)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
        start = end
    return out, lse if arguments["softmax_lse_flag"] else torch.zeros(1)


def _rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): y = x / rms(x) * gamma over the last dimension."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def _swiglu(x, dim=-1):
    """silu(first half) * second half along `dim`."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def _rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
    """x * r1 + rotate_half(x) * r2 on 4-d tensors (r1, r2 broadcast to x)."""
    _check(rotary_mode == "half" and rotate is None, "the reference models rotary_mode 'half' only")
    _check(x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-d tensors")
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(x.dtype)


_LIBRARY = torch.library.Library("npu", "FRAGMENT")
for _name, _impl in [("npu_scatter_pa_kv_cache", _scatter_pa_kv_cache),
                     ("npu_fused_infer_attention_score", _fused_infer_attention_score),
                     ("npu_rms_norm", _rms_norm), ("npu_swiglu", _swiglu), ("npu_rotary_mul", _rotary_mul)]:
    _LIBRARY.define(SCHEMAS[_name])
    _LIBRARY.impl(_name, _impl, "CPU")

npu_scatter_pa_kv_cache = torch.ops.npu.npu_scatter_pa_kv_cache
npu_fused_infer_attention_score = torch.ops.npu.npu_fused_infer_attention_score
npu_rms_norm = torch.ops.npu.npu_rms_norm
npu_swiglu = torch.ops.npu.npu_swiglu
npu_rotary_mul = torch.ops.npu.npu_rotary_mul


# --- MLA (DeepSeek-V3's multi-head latent attention), as vllm-ascend's attention/mla_v1.py calls it ---

MLA_SCHEMAS = {
    "npu_kv_rmsnorm_rope_cache": (
        "npu_kv_rmsnorm_rope_cache(Tensor kv, Tensor gamma, Tensor cos, Tensor sin, Tensor index, Tensor k_cache, "
        "Tensor ckv_cache, *, Tensor? k_rope_scale=None, Tensor? c_kv_scale=None, Tensor? k_rope_offset=None, "
        "Tensor? c_kv_offset=None, Tensor? v=None, float epsilon=1e-5, str cache_mode='Norm', bool "
        "is_output_kv=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_interleave_rope": (
        "npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"
    ),
    "npu_fused_infer_attention_score_v2": (
        "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, "
        "Tensor? key_rope=None, Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
        "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, Tensor? dequant_scale_query=None, Tensor? "
        "dequant_scale_key=None, Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, Tensor? "
        "dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, Tensor? quant_scale_out=None, Tensor? "
        "quant_offset_out=None, Tensor? quant_scale_p=None, Tensor? learnable_sink=None, int num_query_heads=1, "
        "int num_key_value_heads=0, float softmax_scale=1.0, int pre_tokens=2147483647, int "
        "next_tokens=2147483647, str input_layout=\"BSH\", int sparse_mode=0, int block_size=0, int "
        "query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, bool "
        "return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, int? value_dtype=None, int? "
        "query_rope_dtype=None, int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, int? "
        "value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, "
        "int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, int? out_dtype=None) -> "
        "(Tensor, Tensor)"
    ),
}
# The sizes the MLA ops take (their documentation): a 512-value latent, a 64-value rope key.
_MLA_RANK, _MLA_ROPE = 512, 64


def _deinterleave_rope(x, cos, sin):
    """The ops' interleaved RoPE: adjacent pairs gathered into halves, then
    x * cos + rotate_half(x) * sin (cos, sin: cat(freqs, freqs) over D)."""
    x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=None, c_kv_scale=None,
                           k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                           is_output_kv=False):
    """kv [B, 1, S, 576]: RMSNorm (gamma [512]) of the first 512 values into
    ckv_cache, interleaved RoPE (cos, sin [B, 1, S, 64]) of the last 64 into
    k_cache, each token at its global slot index [B * S] (int64) of caches
    (num_blocks, block_size, 1, D): the paged modes "PA" / "PA_BNSD" only (the NZ
    ones are fractal layouts, "Norm" is per batch row). Returns (k_cache,
    ckv_cache, k_embed_out [B, 1, S, 64], y_out [B, 1, S, 512]); the last two
    only with is_output_kv, empty otherwise."""
    _check(cache_mode in ("PA", "PA_BNSD"), f"cache_mode {cache_mode!r}: the reference lays out PA / PA_BNSD only")
    _check(all(t is None for t in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset, v)),
           "quantized caches are not modelled")
    _check(kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[3] == _MLA_RANK + _MLA_ROPE, "kv [B, 1, S, 576]")
    _check(gamma.shape == (_MLA_RANK,), "gamma [512]")
    _check(cos.shape == sin.shape == (*kv.shape[:3], _MLA_ROPE), "cos, sin [B, 1, S, 64]")
    _check(index.dtype == torch.int64 and index.shape == (kv.shape[0] * kv.shape[2],), "index int64 [B * S]")
    _check(k_cache.dim() == 4 and k_cache.shape[2:] == (1, _MLA_ROPE) and ckv_cache.shape[2:] == (1, _MLA_RANK)
           and k_cache.shape[:2] == ckv_cache.shape[:2], "caches (blocks, block_size, 1, 64 / 512)")
    _check(k_cache.is_contiguous() and ckv_cache.is_contiguous(), "non-contiguous caches")
    x = kv.float().reshape(-1, _MLA_RANK + _MLA_ROPE)
    latent = x[:, :_MLA_RANK]
    y = latent * torch.rsqrt(latent.pow(2).mean(dim=-1, keepdim=True) + epsilon) * gamma.float()
    k_embed = _deinterleave_rope(x[:, _MLA_RANK:], cos.float().reshape(-1, _MLA_ROPE),
                                 sin.float().reshape(-1, _MLA_ROPE))
    ckv_cache.view(-1, _MLA_RANK)[index] = y.to(ckv_cache.dtype)
    k_cache.view(-1, _MLA_ROPE)[index] = k_embed.to(k_cache.dtype)
    if not is_output_kv:
        return k_cache, ckv_cache, kv.new_empty(0), kv.new_empty(0)
    return (k_cache, ckv_cache, k_embed.to(kv.dtype).view(*kv.shape[:3], _MLA_ROPE),
            y.to(kv.dtype).view(*kv.shape[:3], _MLA_RANK))


def _interleave_rope(x, cos, sin):
    """x [B, N, S, 64], cos and sin [B, 1, S or 1, 64]: the interleaved RoPE."""
    _check(x.dim() == 4 and x.shape[3] == _MLA_ROPE and x.is_contiguous(), "x [B, N, S, 64], contiguous")
    _check(cos.dim() == 4 and cos.shape[1] == 1 and cos.shape[3] == _MLA_ROPE and cos.shape == sin.shape,
           "cos, sin [B, 1, S, 64]")
    return _deinterleave_rope(x.float(), cos.float(), sin.float()).to(x.dtype)


_ATTENTION_V2_DEFAULTS = {argument.name: argument.default_value
                          for argument in torch._C.parse_schema(
                              MLA_SCHEMAS["npu_fused_infer_attention_score_v2"]).arguments
                          if argument.kwarg_only}
_ATTENTION_V2_MODELLED = ("query_rope", "key_rope", "actual_seq_kvlen", "block_table", "num_query_heads",
                          "num_key_value_heads", "softmax_scale", "input_layout", "block_size")


def _fused_infer_attention_score_v2(query, key, value, **kwargs):
    """MLA's absorbed paged decode: query [B, N, 1, 512] (BNSD, one new token
    per sequence), query_rope [B, N, 1, 64]; key = value, the latent cache
    (blocks, 1, block_size, 512), key_rope (blocks, 1, block_size, 64), read
    through block_table [B, max_blocks] int32 up to actual_seq_kvlen (each
    context length); scores q . k + q_rope . k_rope. input_layout "BNSD_NBSD"
    (out [N, B, 1, 512]) or "BNSD" (out [B, N, 1, 512]). Returns (out, [1] of 0)."""
    unmodelled = {name: v for name, v in kwargs.items() if name not in _ATTENTION_V2_MODELLED}
    _check(all(v == _ATTENTION_V2_DEFAULTS[name] for name, v in unmodelled.items()),
           f"arguments the reference does not model: {sorted(unmodelled)}")
    a = {name: kwargs.get(name, _ATTENTION_V2_DEFAULTS[name]) for name in _ATTENTION_V2_MODELLED}
    q_rope, k_rope, table, block_size = a["query_rope"], a["key_rope"], a["block_table"], a["block_size"]
    _check(a["input_layout"] in ("BNSD", "BNSD_NBSD"), "the reference models BNSD / BNSD_NBSD")
    _check(q_rope is not None and k_rope is not None and table is not None, "MLA: query_rope, key_rope, block_table")
    num_seqs, num_heads = query.shape[:2]
    _check(query.dim() == 4 and query.shape[2] == 1 and query.shape[3] == _MLA_RANK, "query [B, N, 1, 512]")
    _check(num_heads == a["num_query_heads"] and num_heads in (1, 2, 4, 8, 16, 32, 64, 128),
           "num_query_heads: the query's N, a power of two up to 128")
    _check(q_rope.shape == (*query.shape[:3], _MLA_ROPE) and query.is_contiguous() and q_rope.is_contiguous(),
           "query_rope [B, N, 1, 64]; contiguous queries")
    _check(a["num_key_value_heads"] == 1 and key.dim() == 4 and key.shape[1:] == (1, block_size, _MLA_RANK)
           and value.shape == key.shape and k_rope.shape == (key.shape[0], 1, block_size, _MLA_ROPE),
           "key / value (blocks, 1, block_size, 512), key_rope (blocks, 1, block_size, 64)")
    _check(block_size % 16 == 0 and block_size <= 1024, "MLA pages blocks of multiples of 16 up to 1024")
    _check(table.dtype == torch.int32 and table.shape[0] == num_seqs, "block_table int32 [B, max_blocks]")
    kv_lens = list(a["actual_seq_kvlen"])
    _check(len(kv_lens) == num_seqs, "actual_seq_kvlen: one context length per sequence")
    out = torch.empty(num_seqs, num_heads, 1, _MLA_RANK, dtype=query.dtype)
    for b, kv_len in enumerate(kv_lens):
        _check(0 < kv_len <= table.shape[1] * block_size, "KV past the block table")
        blocks = table[b, : -(-kv_len // block_size)].long()
        k = key[blocks].reshape(-1, _MLA_RANK)[:kv_len].float()
        v = value[blocks].reshape(-1, _MLA_RANK)[:kv_len].float()
        kr = k_rope[blocks].reshape(-1, _MLA_ROPE)[:kv_len].float()
        scores = (query[b, :, 0].float() @ k.T + q_rope[b, :, 0].float() @ kr.T) * a["softmax_scale"]
        out[b, :, 0] = (scores.softmax(dim=-1) @ v).to(query.dtype)
    return (out.permute(1, 0, 2, 3).contiguous() if a["input_layout"] == "BNSD_NBSD" else out), torch.zeros(1)


for _name, _impl in [("npu_kv_rmsnorm_rope_cache", _kv_rmsnorm_rope_cache),
                     ("npu_interleave_rope", _interleave_rope),
                     ("npu_fused_infer_attention_score_v2", _fused_infer_attention_score_v2)]:
    _LIBRARY.define(MLA_SCHEMAS[_name])
    _LIBRARY.impl(_name, _impl, "CPU")

npu_kv_rmsnorm_rope_cache = torch.ops.npu.npu_kv_rmsnorm_rope_cache
npu_interleave_rope = torch.ops.npu.npu_interleave_rope
npu_fused_infer_attention_score_v2 = torch.ops.npu.npu_fused_infer_attention_score_v2


from torch_npu import _graphs  # noqa: E402


def _host_memory(device=None) -> tuple[int, int]:
    from services.worker.platforms.base import host_available_memory

    free = host_available_memory()
    return free, free


npu = types.SimpleNamespace(
    is_available=lambda: False,
    device_count=lambda: 1,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    mem_get_info=_host_memory,
    # Graph capture and replay, and the bytes graphs hold (_graphs.py).
    NPUGraph=_graphs.NPUGraph,
    graph=_graphs.graph,
    graph_pool_handle=_graphs.graph_pool_handle,
    memory_allocated=_graphs.memory_allocated,
    memory_reserved=_graphs.memory_reserved,
    empty_cache=lambda: None,
)
torch.npu = npu

# Mixture-of-experts: the router and vllm-ascend's dispatch chain (_moe_ops.py, registered on import).
from torch_npu import _moe_ops  # noqa: E402, F401

npu_moe_gating_top_k = torch.ops.npu.npu_moe_gating_top_k
npu_moe_init_routing_v2 = torch.ops.npu.npu_moe_init_routing_v2
npu_grouped_matmul = torch.ops.npu.npu_grouped_matmul
npu_moe_token_unpermute = torch.ops.npu.npu_moe_token_unpermute

# Quantized matmuls for msModelSlim's W8A8 / W8A8_DYNAMIC / W4A16 (_quant_ops.py).
from torch_npu import _quant_ops  # noqa: E402, F401

npu_dynamic_quant = torch.ops.npu.npu_dynamic_quant
npu_quantize = torch.ops.npu.npu_quantize
npu_quant_matmul = torch.ops.npu.npu_quant_matmul
npu_weight_quant_batchmatmul = torch.ops.npu.npu_weight_quant_batchmatmul
