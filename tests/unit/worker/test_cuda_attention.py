"""The CUDA platform's varlen plumbing on CPU: page tables, cumulative query
starts, seqused_k, the window and the page size, handed to a reference of
torch.nn.attention.varlen.varlen_attn's paged semantics (flash attention
itself runs on a GPU only) and held to attention.py's SDPA path, the oracle.
Not a test of the flash kernel: no GPU here."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

from services.worker.platforms.cuda import CudaPlatform, VarlenAttention, missing_paged_arguments, pages_fit
from tests.unit.worker.paged_oracle import assert_matches_sdpa

CPU = torch.device("cpu")


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                          num_splits=None):
    """varlen_attn over a paged pool, as flash_api.cpp's mha_varlen_fwd reads
    it: key/value (num_pages, page_size, kv_heads, head_dim) with page_size a
    multiple of 256; block_table [B, max_pages] and seqused_k [B] int32; masks
    aligned to the bottom right of each [q, k] block; window (left, right),
    -1 = unbounded."""
    assert block_table is not None and seqused_k is not None, "the paged path"
    assert key.dim() == 4 and key.shape[1] % 256 == 0, "pages (num_pages, k * 256, kv_heads, head_dim)"
    assert {t.dtype for t in (cu_seq_q, cu_seq_k, seqused_k, block_table)} == {torch.int32}
    heads, kv_heads, head_dim = query.shape[1], key.shape[2], query.shape[2]
    assert enable_gqa == (heads != kv_heads) and heads % kv_heads == 0
    num_seqs = block_table.shape[0]
    assert cu_seq_q.shape == (num_seqs + 1,) and int(cu_seq_q[-1]) == query.shape[0]
    lengths_q = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    assert max_q == max(lengths_q) and max_k == int(seqused_k.max())
    assert torch.equal(cu_seq_k[1:] - cu_seq_k[:-1], seqused_k)
    left, right = window_size
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    page_size = key.shape[1]
    for i in range(num_seqs):
        start, n, kv_len = int(cu_seq_q[i]), lengths_q[i], int(seqused_k[i])
        pages = block_table[i, : -(-kv_len // page_size)].long()
        k = key[pages].reshape(-1, kv_heads, head_dim)[:kv_len].repeat_interleave(heads // kv_heads, dim=1)
        v = value[pages].reshape(-1, kv_heads, head_dim)[:kv_len].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[start:start + n].float(), k.float()) * scale
        q_pos = torch.arange(kv_len - n, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        allowed = torch.ones(n, kv_len, dtype=torch.bool)
        if right >= 0:
            allowed &= k_pos <= q_pos + right
        if left >= 0:
            allowed &= k_pos >= q_pos - left
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:start + n] = torch.einsum("hqk,khd->qhd", weights, v.float()).to(query.dtype)
    return out


def test_the_reference_has_varlen_attns_signature():
    """The reference stands in for this torch's varlen_attn: the same parameters,
    kinds and defaults, or a keyword the platform passes could be one torch lacks."""

    def parameters(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(reference_varlen_attn) == parameters(varlen_attn)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 5, 300])
def test_varlen_plumbing_matches_sdpa(heads, kv_heads, head_dim, window):
    """Decodes at and past a page boundary, fresh prompts, and chunks over a cached
    prefix that spans pages, in one step; pages scattered over the pool."""
    block_size = 256
    torch.manual_seed(heads + head_dim)
    kernel = VarlenAttention(heads, kv_heads, head_dim, block_size, attend=reference_varlen_attn)
    assert_matches_sdpa(kernel, heads, kv_heads, head_dim, block_size, 12, new=[1, 1, 1, 3, 21, 19, 100],
                        computed=[0, block_size - 1, block_size + 4, 0, 0, 30, 300], window=window)


def test_flash_pages_by_multiples_of_256_in_half_precision():
    cuda = CudaPlatform(torch.device("cuda"))  # never touches the device here
    assert isinstance(cuda.paged_attention(torch.bfloat16, 8, 2, 64, 256), VarlenAttention)
    assert isinstance(cuda.paged_attention(torch.float16, 8, 2, 64, 512), VarlenAttention)
    assert cuda.paged_attention(torch.bfloat16, 8, 2, 64, 16) is None  # SDPA over gathered K/V
    assert cuda.paged_attention(torch.bfloat16, 8, 2, 64, 128) is None
    assert cuda.paged_attention(torch.float32, 8, 2, 64, 256) is None


def test_a_torch_without_paged_varlen_attends_through_sdpa(monkeypatch):
    """torch 2.11's varlen_attn takes no block_table, seqused_k or enable_gqa: the
    platform must not hand it a paged pool (it would fail at the first step)."""
    import torch.nn.attention.varlen as varlen

    def older_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                          window_size=(-1, -1)):
        raise AssertionError("not to be called")

    monkeypatch.setattr(varlen, "varlen_attn", older_varlen_attn)
    assert missing_paged_arguments() == ["block_table", "seqused_k", "enable_gqa"]
    assert not pages_fit(256, torch.bfloat16)
    assert CudaPlatform(torch.device("cuda")).paged_attention(torch.bfloat16, 8, 2, 64, 256) is None
