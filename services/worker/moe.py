"""Mixture-of-experts MLP blocks for the lean decoder, as transformers computes
them (DeepseekV3MoE, Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock):

- DeepSeek-V3/R1: float32 router logits, sigmoid scores; a selection-only bias
  (e_score_correction_bias); experts in n_group groups, each scored by the sum
  of its top 2, the best topk_group kept, the top k chosen among their
  experts; weights the unbiased scores, renormalised with norm_topk_prob,
  times routed_scaling_factor; shared experts (moe_intermediate_size *
  n_shared_experts) added.
- Qwen3-MoE: router logits in the run dtype, softmax in float32, top k,
  renormalised with norm_topk_prob, the weights rounded to the run dtype.
- Qwen2-MoE: Qwen3's router, plus a shared expert scaled by
  sigmoid(shared_expert_gate(x)) (in the run dtype, as transformers).

The platform selects the experts (Platform.moe_select) and runs them
(Platform.moe_experts: sorted by expert, one grouped GEMM pair, weighted and
added back; platforms/moe_ops.py). Where transformers rounds each expert's
share to the run dtype and adds them there, the routed sum and the shared
experts are added in float32 and rounded once.

A quantized checkpoint's experts (quantization.py) run as stored where every
expert of the shard is int8 or 4-bit (FP8 blocks are stacked dequantized): each on the platform's quantized linear
(Platform.quantized_moe_experts), one call pair per expert with rows.

Checkpoints hold experts one by one (`mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`: what save_pretrained writes) or stacked
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]:
transformers 5's module layout); either is stacked once at load, handed to
the platform, and not kept.

Expert parallelism: `MoE(..., experts=ExpertShard(first, count))` loads and
runs only those routed experts; a token's other experts contribute 0. The
shared experts belong to the shard with first == 0 (the others neither load
nor run them), so over a partition of the experts into shards, one per rank,
the sum of the ranks' outputs (an all-reduce the caller does) is the whole
block. Every rank routes every token (the router is replicated).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.worker.platforms import Platform
from services.worker.platforms.moe_ops import ANY_HEAD_DIM, MoeRouting
from services.worker.quantization import FourBitWeight, Int8Weight, QuantizedWeight, linear_weight

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts first .. first + count - 1 of a layer (one rank's)."""

    first: int
    count: int


class _SharedExperts:
    """A dense SiLU MLP: gate and up in one linear, SiLU-times-up, down (decoder.DenseMlp
    without its residual; not imported from there, as decoder.py will import this module)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], prefix: str, platform: Platform):
        gate_up = linear_weight(tensors, [prefix + "gate_proj", prefix + "up_proj"])
        self.gate_up = platform.linear(gate_up, None)
        self.down = platform.linear(linear_weight(tensors, [prefix + "down_proj"]), None)
        (intermediate, hidden), dtype = gate_up.shape, gate_up.dtype
        self.silu_mul = platform.layer_ops(dtype, hidden, intermediate // 2, ANY_HEAD_DIM).silu_mul

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(self.silu_mul(self.gate_up(h)))


def quantized_experts(tensors: Mapping[str, torch.Tensor], prefix: str,
                      shard: ExpertShard) -> tuple[list[QuantizedWeight], list[QuantizedWeight]] | None:
    """The shard's experts as the checkpoint quantized them (gate and up side by
    side, down), where it stored every one of them so that a platform's quantized
    linears take them (quantization.linear_weight); None otherwise."""
    if getattr(tensors, "quantized", None) is None:
        return None
    gate_up, down = [], []
    for expert in range(shard.first, shard.first + shard.count):
        name = f"{prefix}experts.{expert}."
        gate_up.append(linear_weight(tensors, [name + "gate_proj", name + "up_proj"]))
        down.append(linear_weight(tensors, [name + "down_proj"]))
        if not (isinstance(gate_up[-1], (Int8Weight, FourBitWeight)) and isinstance(down[-1], (Int8Weight, FourBitWeight))):
            return None  # float, or FP8 blocks: stacked dequantized for the grouped GEMMs
    return gate_up, down


def stacked_experts(tensors: Mapping[str, torch.Tensor], prefix: str,
                    shard: ExpertShard) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's experts as gate_up [count, 2I, H] and down [count, H, I],
    from either checkpoint layout (the module docstring)."""
    experts = range(shard.first, shard.first + shard.count)
    if prefix + "experts.gate_up_proj" in tensors:
        gate_up, down = tensors[prefix + "experts.gate_up_proj"], tensors[prefix + "experts.down_proj"]
        if shard.count == gate_up.shape[0]:
            return gate_up, down
        # Copies, so the other experts' memory goes with the loaded tensors.
        return gate_up[experts.start : experts.stop].clone(), down[experts.start : experts.stop].clone()
    first = tensors[f"{prefix}experts.{shard.first}.gate_proj.weight"]
    intermediate, hidden = first.shape
    # Filled expert by expert: at most one expert's tensors beside the stack.
    gate_up = torch.empty(shard.count, 2 * intermediate, hidden, dtype=first.dtype, device=first.device)
    down = torch.empty(shard.count, hidden, intermediate, dtype=first.dtype, device=first.device)
    for row, expert in enumerate(experts):
        name = f"{prefix}experts.{expert}."
        gate_up[row, :intermediate] = first if row == 0 else tensors[name + "gate_proj.weight"]
        gate_up[row, intermediate:] = tensors[name + "up_proj.weight"]
        down[row] = tensors[name + "down_proj.weight"]
    return gate_up, down


class MoE:
    """One layer's MoE block: h [T, hidden] -> [T, hidden], without the residual."""

    @staticmethod
    def is_moe_layer(config, layer_index: int) -> bool:
        """Whether layer `layer_index` of `config`'s model has an MoE block (transformers'
        rule per family): DeepSeek-V3's first first_k_dense_replace layers are dense
        (DeepSeek's own moe_layer_freq is 1 in V3/R1, and transformers reads none);
        Qwen2/3-MoE's layers in mlp_only_layers are dense, the others MoE every
        decoder_sparse_step layers (layer + 1 a multiple of it). Other families: False."""
        model_type = getattr(config, "model_type", None)
        if model_type == "deepseek_v3":
            return layer_index >= config.first_k_dense_replace
        if model_type in ("qwen3_moe", "qwen2_moe"):
            return (layer_index not in (config.mlp_only_layers or []) and config.num_experts > 0
                    and (layer_index + 1) % config.decoder_sparse_step == 0)
        return False

    def __init__(self, config, tensors: Mapping[str, torch.Tensor], prefix: str, platform: Platform,
                 experts: ExpertShard | None = None):
        """`tensors`: the checkpoint's tensors by name in the run dtype and on the
        device (a Checkpoint, or a state_dict); `prefix`: the layer's MLP,
        "model.layers.{i}.mlp."; `experts`: this rank's shard of the routed
        experts (None: all of them; the module docstring says what the caller does)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in FAMILIES:
            raise ValueError(f"no MoE block for model type {model_type!r}; one of {FAMILIES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"MoE experts run SiLU-times-up, not {config.hidden_act!r}")
        deepseek = model_type == "deepseek_v3"
        num_experts: int = config.n_routed_experts if deepseek else config.num_experts
        shard = experts or ExpertShard(0, num_experts)
        if shard.count < 1 or shard.first < 0 or shard.first + shard.count > num_experts:
            raise ValueError(f"expert shard {shard} outside the layer's {num_experts} experts")
        self.platform = platform
        router_weight = tensors[prefix + "gate.weight"]
        self.dtype = router_weight.dtype
        # DeepSeek's router runs in float32 whatever the run dtype; Qwen's in the run dtype.
        self.float32_router = deepseek
        self.gate = platform.linear(router_weight.float() if deepseek else router_weight, None)
        bias = tensors.get(prefix + "gate.e_score_correction_bias") if deepseek else None
        self.routing = MoeRouting(
            top_k=config.num_experts_per_tok,
            scoring="sigmoid" if deepseek else "softmax",
            renormalize=bool(config.norm_topk_prob),
            num_groups=config.n_group if deepseek else 1,
            topk_groups=config.topk_group if deepseek else 1,
            scaling_factor=float(config.routed_scaling_factor) if deepseek else 1.0,
            bias=None if bias is None else bias.float(),
        )
        quantized = quantized_experts(tensors, prefix, shard)
        if quantized is not None:  # run as stored, on the platform's quantized linears
            self.experts = platform.quantized_moe_experts(*quantized, shard.first, num_experts)
        else:
            gate_up, down = stacked_experts(tensors, prefix, shard)
            self.experts = platform.moe_experts(gate_up, down, shard.first, num_experts)
            del gate_up, down  # the platform holds its own layout (or these, for the torch reference)
        self.shared: _SharedExperts | None = None
        self.shared_gate = None
        if shard.first == 0:
            shared_prefix = prefix + ("shared_experts." if deepseek else "shared_expert.")
            if shared_prefix + "gate_proj.weight" in tensors:
                self.shared = _SharedExperts(tensors, shared_prefix, platform)
            if model_type == "qwen2_moe":
                self.shared_gate = platform.linear(tensors[prefix + "shared_expert_gate.weight"], None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:
            return torch.zeros_like(h)
        logits = self.gate(h.float() if self.float32_router else h)
        weights, ids = self.platform.moe_select(logits, self.routing)
        if not self.float32_router:
            weights = weights.to(self.dtype)  # Qwen's routers hand their weights on in the run dtype
        out = self.experts(h, weights, ids).float()
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(h)) * shared
            out += shared.float()
        return out.to(h.dtype)
