"""Mixture-of-experts on Ascend (npu.py's NpuPlatform.moe_select and
moe_experts): which routings npu_moe_gating_top_k computes, and the routed
experts on vllm-ascend's op chain. Never run on an NPU here: tests/fake_npu's
reference ops check the calls on CPU (tests/unit/worker/test_moe.py)."""
from __future__ import annotations

import torch

from services.worker.platforms.moe_ops import MoeRouting


def gating_fits(num_experts: int, routing: MoeRouting) -> bool:
    """Whether npu_moe_gating_top_k computes this routing: its documented limits
    (at most 2,048 experts, more than 2 per group, the group size aligned to 32
    times the groups at most 2,048, k at most the kept groups' experts), sigmoid
    scores renormalised (the op always renormalises them), and vllm-ascend's
    stricter k <= E / (groups * kept groups) (AscendFusedTopKRouter.is_fused_supported)."""
    groups, kept, k = routing.num_groups, routing.topk_groups, routing.top_k
    if num_experts > 2048 or num_experts % groups or num_experts // groups <= 2 or not 1 <= kept <= groups:
        return False
    per_group = num_experts // groups
    if -(-per_group // 32) * 32 * groups > 2048 or k > per_group * kept or k * groups * kept > num_experts:
        return False
    return routing.scoring == "softmax" or routing.renormalize


class NpuExperts:
    """The routed experts as vllm-ascend's all-gather dispatcher runs them:
    npu_moe_init_routing_v2 (rows sorted by expert, this shard's experts by
    active_expert_range, counts per expert), npu_grouped_matmul with the
    counts as group_list, npu_swiglu, npu_grouped_matmul, and
    npu_moe_token_unpermute (each token's rows weighted and summed): no host sync."""

    def __init__(self, torch_npu, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int,
                 num_experts: int | None):
        self._npu = torch_npu
        # The grouped matmul takes weights [E, in, out]: transposed once, as vllm-ascend does at load.
        self._gate_up = gate_up.transpose(1, 2).contiguous()
        self._down = down.transpose(1, 2).contiguous()
        num_local = gate_up.shape[0]
        self._num_experts = num_experts or num_local
        self._range = [first_expert, first_expert + num_local]
        self._sharded = num_local != self._num_experts

    def _grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_grouped_matmul([x], [weight], group_list=counts, split_item=2, group_type=0,
                                            group_list_type=1)[0]  # group_list holds counts; one output

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, k = ids.shape
        expanded_x, row_index, counts, _ = self._npu.npu_moe_init_routing_v2(
            x, ids.to(torch.int32), active_num=tokens * k, expert_num=self._num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=self._range, quant_mode=-1)
        y = self._grouped_matmul(self._npu.npu_swiglu(self._grouped_matmul(expanded_x, self._gate_up, counts),
                                                      dim=-1), self._down, counts)
        if self._sharded:
            # Another shard's (token, expert) pairs have index -1, and the rows past this
            # shard's are not computed: those pairs take those rows, zeroed (unpermute
            # takes each index once), where vllm-ascend points them all at row 1.
            local, computed = row_index >= 0, counts.sum()
            spare = computed + torch.cumsum(~local, 0) - 1
            row_index = torch.where(local, row_index, spare.to(torch.int32))
            y = torch.where((torch.arange(tokens * k, device=y.device) < computed)[:, None], y, 0)
        # unpermute takes probs in the tokens' dtype (its documented dtypes, and how vllm-ascend calls it).
        return self._npu.npu_moe_token_unpermute(permuted_tokens=y, sorted_indices=row_index,
                                                 probs=weights.to(y.dtype))
