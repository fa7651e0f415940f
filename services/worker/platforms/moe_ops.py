"""Mixture-of-experts operations a platform owns, in plain torch: expert
selection (`select_experts`) and the routed experts (`TorchExperts`). They are
Platform.moe_select / Platform.moe_experts where a device has nothing better,
and the reference the CPU kernel and the NPU op chain are tested against.

Layouts: gate_up [E, 2I, H] (each expert's gate rows, then its up rows, as
transformers' stacked `gate_up_proj`), down [E, H, I]. An expert's output is
down(silu(gate(x)) * up(x)); a token's routed output is the sum over its k
experts of weight * output. The experts are sorted by id (argsort of the
flattened top-k ids), each expert with rows runs them as one GEMM pair, and the
rows are weighted and added back to their tokens (index_add): no loop over
tokens, none over experts without rows."""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

# DeepSeek-V3's renormalisation adds this to the denominator (transformers and Ascend's op alike).
RENORM_EPS = 1e-20
# Platform.layer_ops' head_dim is the rotary's; where only SiLU-times-up is wanted, one every kernel takes.
ANY_HEAD_DIM = 64


@dataclass(frozen=True)
class MoeRouting:
    """How a router turns logits [T, E] into k experts and weights per token."""

    top_k: int
    scoring: str  # "softmax" (Qwen-MoE) or "sigmoid" (DeepSeek-V3)
    renormalize: bool  # the k weights divided by their sum (norm_topk_prob)
    num_groups: int = 1  # DeepSeek's n_group: experts in groups, groups chosen first
    topk_groups: int = 1  # groups kept, each scored by the sum of its top 2
    scaling_factor: float = 1.0  # routed_scaling_factor, on the final weights
    bias: torch.Tensor | None = None  # float32 [E], added to the scores for choosing only

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown expert scoring {self.scoring!r}")


def select_experts(logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, ids [T, k] int64), as
    transformers' DeepseekV3TopkRouter (sigmoid) and Qwen2/3-MoE's
    TopKRouter (softmax; they round the weights to the run dtype after, which
    moe.py does) compute them."""
    k = routing.top_k
    if routing.scoring == "softmax":
        # Qwen's logits come in the run dtype; the softmax is float32 either way.
        weights, ids = F.softmax(logits, dim=-1, dtype=torch.float32).topk(k, dim=-1)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * routing.scaling_factor if routing.scaling_factor != 1.0 else weights, ids
    scores = logits.float().sigmoid()
    choice = scores if routing.bias is None else scores + routing.bias
    if routing.num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, routing.num_groups, experts // routing.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept = group_scores.topk(routing.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(tokens, experts)
    ids = choice.topk(k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)  # the unbiased scores weigh the experts
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    return weights * routing.scaling_factor, ids


class MoeExperts(Protocol):
    """The routed experts of one layer (or of one shard of its experts)."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights [T, k] (float32 or x's dtype); ids [T, k] global
        expert ids -> [T, H], float32 or x's dtype: the sum over each token's
        experts in this shard of weight * expert(x); 0 where it has none here."""
        ...


@dataclass(frozen=True)
class SortedRows:
    """A step's (token, expert) pairs sorted by expert, as the experts take them."""

    token: torch.Tensor  # [T * k] int64: the token of each sorted row
    order: torch.Tensor  # [T * k] int64: each sorted row's position in the flattened [T, k]
    counts: torch.Tensor  # [E_local] int64: rows of each local expert; the rows after them are other shards'
    local: torch.Tensor | None  # [T * k] bool: whether a sorted row is this shard's (None: all are)


def sort_by_expert(ids: torch.Tensor, first_expert: int, num_local: int, sharded: bool) -> SortedRows:
    """The flattened top-k ids sorted by expert; another shard's experts sort
    last (as one more expert), so this shard's rows are the first sum(counts)."""
    flat = ids.reshape(-1).long()
    if first_expert:
        flat = flat - first_expert
    local = None
    if sharded:
        is_local = (flat >= 0) & (flat < num_local)
        flat = torch.where(is_local, flat, num_local)
    order = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the largest id back to size its output (a
    # host sync, which a captured graph cannot hold).
    counts = flat.new_zeros(num_local + 1).scatter_add_(0, flat, torch.ones_like(flat))[:num_local]
    if sharded:
        local = is_local.index_select(0, order)
    return SortedRows(token=order // ids.shape[1], order=order, counts=counts, local=local)


class SortedExperts:
    """A MoeExperts that sorts the rows by expert, runs them (`run_sorted`, the
    device's part), then weighs and adds each row back to its token in float32."""

    def __init__(self, num_local: int, first_expert: int = 0, num_experts: int | None = None):
        """The experts first_expert .. first_expert + num_local - 1 of num_experts (default: all)."""
        self.num_local, self.first_expert = num_local, first_expert
        self.num_experts = num_experts or num_local
        self.sharded = num_local != self.num_experts

    def run_sorted(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_sorted [N, H], rows of expert e after those of experts < e (counts
        [E_local]) -> each row through its expert, [N, H]; rows past
        sum(counts) are other shards' and may hold anything."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = sort_by_expert(ids, self.first_expert, self.num_local, self.sharded)
        y_sorted = self.run_sorted(x.index_select(0, rows.token), rows.counts)
        return self.combine(y_sorted, weights, rows, x.shape[0])

    def combine(self, y_sorted: torch.Tensor, weights: torch.Tensor, rows: SortedRows,
                num_tokens: int) -> torch.Tensor:
        """Each token's rows weighted and summed, float32 [T, H] (moe_ops.combine; devices may fuse it)."""
        return combine(y_sorted, weights, rows, num_tokens)


class TorchExperts(SortedExperts):
    """The reference: one F.linear pair per expert with rows."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                 num_experts: int | None = None):
        """gate_up [E_local, 2I, H] and down [E_local, H, I]."""
        super().__init__(gate_up.shape[0], first_expert, num_experts)
        self.gate_up, self.down = gate_up, down

    def run_sorted(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return each_expert(x_sorted, counts, self._expert)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[expert])


class LinearExperts(SortedExperts):
    """Each expert with rows on a platform's prepared linears (Platform.linear)
    and its SiLU-times-up: where a device has no grouped GEMM for the dtype."""

    def __init__(self, gate_up: list, down: list, silu_mul, first_expert: int = 0, num_experts: int | None = None):
        """gate_up, down: one prepared linear per local expert; silu_mul: LayerOps.silu_mul."""
        super().__init__(len(gate_up), first_expert, num_experts)
        self.gate_up, self.down, self.silu_mul = gate_up, down, silu_mul

    def run_sorted(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return each_expert(x_sorted, counts, lambda e, rows: self.down[e](self.silu_mul(self.gate_up[e](rows))))


def each_expert(x_sorted: torch.Tensor, counts: torch.Tensor,
                run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """run(expert, its rows) over each local expert with rows, in sorted order
    (SortedExperts.run_sorted's contract); rows past sum(counts) stay zero."""
    y = torch.zeros_like(x_sorted)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            y[start : start + count] = run(expert, x_sorted[start : start + count])
            start += count
    return y


def combine(y_sorted: torch.Tensor, weights: torch.Tensor, rows: SortedRows, num_tokens: int) -> torch.Tensor:
    """sum over each token's rows of weight * y, float32 [T, H]: rounded once by
    the caller, where transformers rounds each expert's share in the run dtype."""
    row_weights = weights.reshape(-1).index_select(0, rows.order).float()
    contribution = y_sorted.float() * row_weights[:, None]
    if rows.local is not None:  # other shards' rows: whatever run_sorted left there counts for nothing
        contribution = torch.where(rows.local[:, None], contribution, 0.0)
    out = torch.zeros(num_tokens, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    return out.index_add_(0, rows.token, contribution)
