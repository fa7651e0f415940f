"""The fake torch_npu's mixture-of-experts ops (the package docstring says what
a reference op here is): the router and vllm-ascend's dispatch chain, under
op-plugin's schemas (op_plugin/config/op_plugin_functions.yaml; the router's
input_ids / tid2eid and init_routing's x_dtype are newer than torch_npu
26.0.0, and our calls pass neither), with the semantics of Ascend's
documentation (docs/zh/custom_APIs/torch_npu/*.md and its reference code, the
aclnnMoeTokenUnpermute page) and op-plugin's tests. What an op leaves
unwritten (rows past the routed ones) is NaN here, so code that reads it fails.

Imported by the package's __init__ (its library fragment and _check)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_npu import _LIBRARY, _check

MOE_SCHEMAS = {
    "npu_moe_gating_top_k": (
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, bool "
        "out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
    ),
    "npu_moe_init_routing_v2": (
        "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int "
        "active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int "
        "expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] "
        "active_expert_range=[], int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_grouped_matmul": (
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, Tensor[]? "
        "offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, Tensor[]? "
        "per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, Tensor[]? "
        "activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, int? "
        "group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? "
        "output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, int? "
        "per_token_scale_dtype=None) -> Tensor[]"
    ),
    "npu_moe_token_unpermute": (
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, bool "
        "padded_mode=False, int[]? restore_shape=None) -> Tensor"
    ),
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT32_MAX = 2147483647


def _moe_gating_top_k(x, k, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1, group_select_mode=0,
                      renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """x [T, E] logits: softmax (norm_type 0) or sigmoid (1) scores, plus bias
    [E] (x's dtype) for choosing only; groups (group_count) scored by their
    maximum (group_select_mode 0) or top-2 sum (1), the best k_group kept, the
    best k of their experts chosen. y = the chosen unbiased scores, divided by
    their sum + eps for sigmoid only, times routed_scaling_factor. Returns
    (y [T, k] in x's dtype, expert_idx [T, k] int32, the scores [T, E] float32
    with out_flag, else empty); renorm 0 only (the documentation's "only 0")."""
    _check(input_ids is None and tid2eid is None, "hash routing is not modelled")
    _check(renorm == 0 and norm_type in (0, 1) and group_select_mode in (0, 1), "renorm 0, norm_type 0 / 1")
    _check(x.dim() == 2 and x.dtype in _FLOATS, f"x [T, E] float, got {x.dtype} {tuple(x.shape)}")
    tokens, experts = x.shape
    _check(bias is None or (bias.shape == (experts,) and bias.dtype == x.dtype), "bias [E] in x's dtype")
    _check(experts <= 2048 and group_count > 0 and experts % group_count == 0 and experts // group_count > 2,
           f"{experts} experts in {group_count} groups: at most 2048, more than 2 a group")
    per_group = experts // group_count
    _check(-(-per_group // 32) * 32 * group_count <= 2048, "a group's experts aligned to 32, times the groups, > 2048")
    _check(1 <= k_group <= group_count and 1 <= k <= per_group * k_group, f"k {k}, k_group {k_group}")
    scores = F.softmax(x.float(), dim=-1) if norm_type == 0 else x.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choice.view(tokens, group_count, per_group)
        group_scores = grouped.amax(dim=-1) if group_select_mode == 0 else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.argsort(-group_scores, dim=-1, stable=True)[:, :k_group]
        dropped = torch.ones(tokens, group_count, dtype=torch.bool).scatter_(1, kept, False)
        choice = grouped.masked_fill(dropped[..., None], float("-inf")).view(tokens, experts)
    ids = torch.argsort(-choice, dim=-1, stable=True)[:, :k]
    y = scores.gather(1, ids)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), ids.to(torch.int32), scores if out_flag else torch.empty(0)


def _moe_init_routing_v2(x, expert_idx, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1,
                         drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                         active_expert_range=(), row_idx_type=0, x_dtype=None):
    """Dropless and unquantized: the pairs (row, j) of expert_idx [N, K] int32
    sorted by expert (stable), those of experts in active_expert_range
    [start, end) first. Returns (expanded_x [N * K or min(active_num, N * K),
    H]: x's row of each sorted in-range pair, the rest not written;
    expanded_row_idx [N * K] int32: per pair row * K + j its expanded row,
    -1 out of range (row_idx_type 0, gather) or the sorted pairs
    (row_idx_type 1, scatter); the rows of each expert in range, int64,
    counts (expert_tokens_num_type 1) or their running sum (0), empty without
    expert_tokens_num_flag; expanded_scale [N] float32, meaningless without scale)."""
    _check(scale is None and offset is None and quant_mode == -1 and x_dtype is None, "quantization is not modelled")
    _check(drop_pad_mode == 0, "drop / pad mode is not modelled")
    _check(expert_tokens_num_type in (0, 1), "expert_tokens_num_type 0 / 1 (key-value mode is not modelled)")
    _check(row_idx_type in (0, 1), "row_idx_type 0 or 1")
    _check(x.dim() == 2 and x.dtype in _FLOATS, "x [N, H] float")
    _check(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0] and expert_idx.dtype == torch.int32,
           "expert_idx [N, K] int32")
    start, end = list(active_expert_range) or [0, expert_num]
    _check(0 < expert_num and 0 <= start < end <= expert_num, f"active_expert_range {start, end} of {expert_num}")
    rows, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    _check(bool(((flat >= 0) & (flat < expert_num)).all()), "an expert id out of [0, expert_num)")
    in_range = (flat >= start) & (flat < end)
    order = torch.argsort(torch.where(flat < start, _INT32_MAX, flat), stable=True)
    available = int(in_range.sum())
    if row_idx_type == 1:
        row_index = order.to(torch.int32)
    else:
        row_index = torch.full((rows * k,), -1, dtype=torch.int32)
        row_index[order[:available]] = torch.arange(available, dtype=torch.int32)
    counts = torch.bincount(flat[in_range] - start, minlength=end - start)
    counts = (counts if expert_tokens_num_type == 1 else torch.cumsum(counts, 0)).to(torch.int64)
    out_rows = rows * k if active_num in (-1, 0) else min(active_num, rows * k)
    active = min(available, out_rows)
    expanded_x = torch.full((out_rows, x.shape[1]), float("nan"), dtype=x.dtype)
    expanded_x[:active] = x[order[:active] // k]
    return (expanded_x, row_index, counts if expert_tokens_num_flag else torch.empty(0, dtype=torch.int64),
            torch.empty(rows, dtype=torch.float32))


_GROUPED_MATMUL_MODELLED = ("group_list", "split_item", "group_type", "group_list_type", "act_type")


def _grouped_matmul(x, weight, **kwargs):
    """One x [M, K] split along M (group_type 0) by group_list [E] int64
    (group_list_type 0: running ends, 1: counts) over one weight [E, K, N]:
    rows of group e times weight[e]; split_item 2 / 3: one output [M, N] in
    x's dtype, the rows past the groups not written. Nothing else modelled."""
    unmodelled = {name: value for name, value in kwargs.items()
                  if name not in _GROUPED_MATMUL_MODELLED and value is not None}
    _check(not unmodelled, f"arguments the reference does not model: {sorted(unmodelled)}")
    group_list, group_type = kwargs.get("group_list"), kwargs.get("group_type")
    list_type, split_item = kwargs.get("group_list_type", 0), kwargs.get("split_item", 0)
    _check(group_type is not None, "group_type must be passed (op-plugin requires it)")
    _check(group_type == 0 and split_item in (2, 3) and kwargs.get("act_type", 0) == 0,
           "the reference models M-axis groups (group_type 0), one output (split_item 2 / 3), no activation")
    _check(len(x) == 1 and len(weight) == 1, "one x and one weight")
    x, weight = x[0], weight[0]
    _check(x.dim() == 2 and weight.dim() == 3 and weight.shape[1] == x.shape[1] and x.dtype == weight.dtype,
           f"x [M, K] and weight [E, K, N] of one dtype, got {tuple(x.shape)} and {tuple(weight.shape)}")
    _check(group_list is not None and group_list.dtype == torch.int64 and group_list.shape == weight.shape[:1],
           "group_list int64 [E]")
    _check(list_type in (0, 1), "group_list_type 0 (running ends) or 1 (counts)")
    counts = group_list if list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    _check(bool((counts >= 0).all()) and int(counts.sum()) <= x.shape[0], "group sizes negative or past M")
    out = torch.full((x.shape[0], weight.shape[2]), float("nan"), dtype=x.dtype)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        out[start : start + count] = (x[start : start + count].float() @ weight[expert].float()).to(x.dtype)
        start += count
    return [out]


def _moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """out [T, H] = sum over j < K of permuted_tokens[sorted_indices[t * K + j]]
    * probs[t, j] (K = probs' second dimension, 1 without probs): the indices
    int32, each row of permuted_tokens [T * K, H] taken once (aclnnMoeTokenUnpermute:
    "no repeated indices"); probs in the tokens' dtype (op-plugin's tests,
    vllm-ascend's calls: what this reference holds our code to)."""
    _check(not padded_mode, "padded mode is not modelled")
    _check(permuted_tokens.dim() == 2 and sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32,
           "permuted_tokens [T * K, H], sorted_indices int32 [T * K]")
    _check(sorted_indices.numel() == permuted_tokens.shape[0], "one index per permuted row")
    k = 1 if probs is None else probs.shape[1]
    _check(probs is None or (probs.dim() == 2 and probs.numel() == sorted_indices.numel()
                             and probs.dtype == permuted_tokens.dtype), "probs [T, K] in the tokens' dtype")
    index = sorted_indices.long()
    _check(bool(((index >= 0) & (index < permuted_tokens.shape[0])).all()), "an index out of range")
    _check(index.unique().numel() == index.numel(), "a repeated index")
    rows = permuted_tokens.float()[index]
    if probs is not None:
        rows = rows * probs.float().reshape(-1, 1)
    return rows.view(-1, k, permuted_tokens.shape[1]).sum(dim=1).to(permuted_tokens.dtype)


for _name, _impl in [("npu_moe_gating_top_k", _moe_gating_top_k), ("npu_moe_init_routing_v2", _moe_init_routing_v2),
                     ("npu_grouped_matmul", _grouped_matmul), ("npu_moe_token_unpermute", _moe_token_unpermute)]:
    _LIBRARY.define(MOE_SCHEMAS[_name])
    _LIBRARY.impl(_name, _impl, "CPU")
