"""MoE blocks (services/worker/moe.py) against transformers' own modules on the
same weights, read back from a save_pretrained directory through Checkpoint
(experts one by one on disk); the NPU op chain through tests/fake_npu against
the CPU path; expert shards; which layers are MoE; bfloat16 against float32."""
from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig

from services.worker import cpu_kernels
from services.worker.checkpoint import Checkpoint
from services.worker.moe import ExpertShard, MoE, stacked_experts
from services.worker.platforms.cpu import CpuPlatform, GroupedCpuExperts
from services.worker.platforms.moe_ops import TorchExperts

CPU = torch.device("cpu")
PREFIX = "model.layers.1.mlp."  # layer 0 is dense in every config here
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=32, experts_implementation="eager")


def tiny_config(family: str, **overrides):
    if family == "deepseek_v3":  # fits npu_moe_gating_top_k: 8 experts a group, k * groups * kept <= E
        return DeepseekV3Config(**{**TINY, "n_routed_experts": 32, "n_shared_experts": 2, "num_experts_per_tok": 4,
                                   "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                                   "routed_scaling_factor": 2.5, "q_lora_rank": 32, "kv_lora_rank": 16,
                                   "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, **overrides})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{**TINY, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                 "mlp_only_layers": [0], **overrides})
    return Qwen2MoeConfig(**{**TINY, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                             "shared_expert_intermediate_size": 48, **overrides})


CASES = {  # name: (family, config overrides)
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-renorm": ("deepseek_v3", {"norm_topk_prob": False}),
    "qwen3_moe-renorm": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen2_moe": ("qwen2_moe", {}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (config, the HF model, its save_pretrained directory), built once."""
    built = {}

    def build(name: str):
        if name not in built:
            family, overrides = CASES[name]
            config = tiny_config(family, **overrides)
            torch.manual_seed(len(built))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
            with torch.no_grad():
                for buffer_name, buffer in model.named_buffers():
                    if buffer_name.endswith("e_score_correction_bias"):  # zeros from a config: unbiased choice
                        buffer.copy_(torch.rand_like(buffer) * 0.1)
                for parameter in model.parameters():  # larger than init's 0.02: routing and outputs well apart
                    parameter.mul_(5.0)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            built[name] = (config, model, directory)
        return built[name]

    return build


def reference(model, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model.layers[1].mlp(h[None])[0]


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, relative: float) -> None:
    scale = theirs.abs().max().item()
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert (ours.float() - theirs.float()).abs().max().item() <= relative * scale, (ours, theirs)


def tokens(count: int, hidden: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(count)).to(dtype)


@pytest.mark.parametrize("count", [1, 7, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_block_matches_transformers(saved, name, count):
    config, model, directory = saved(name)
    moe = MoE(config, Checkpoint(directory, torch.float32, CPU), PREFIX, CpuPlatform(CPU))
    h = tokens(count)
    assert_close(moe(h), reference(model, h), 1e-5)


def test_the_stacked_layout_of_transformers_5_loads_too(saved):
    """A state_dict of transformers' modules: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    config, model, _ = saved("qwen2_moe")
    state = model.state_dict()
    assert PREFIX + "experts.gate_up_proj" in state and PREFIX + "experts.0.up_proj.weight" not in state
    h = tokens(7)
    assert_close(MoE(config, state, PREFIX, CpuPlatform(CPU))(h), reference(model, h), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the grouped kernel where built
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe-renorm", "qwen2_moe"])
def test_expert_shards_sum_to_the_whole_block(saved, name, dtype):
    """Shards split unevenly; the shared experts come with the shard at expert 0."""
    config, _, directory = saved(name)
    weights, platform = Checkpoint(directory, dtype, CPU), CpuPlatform(CPU)
    num_experts = config.n_routed_experts if name == "deepseek_v3" else config.num_experts
    whole = MoE(config, weights, PREFIX, platform)
    first = MoE(config, weights, PREFIX, platform, experts=ExpertShard(0, 3))
    rest = MoE(config, weights, PREFIX, platform, experts=ExpertShard(3, num_experts - 3))
    assert first.shared is not None or name == "qwen3_moe-renorm"
    assert rest.shared is None and rest.shared_gate is None
    h = tokens(64, dtype=dtype)
    # bfloat16: each part rounds once on its own.
    assert_close(first(h) + rest(h), whole(h), 1e-5 if dtype == torch.float32 else 1e-2)


def test_a_shard_outside_the_layer_is_refused(saved):
    config, _, directory = saved("qwen2_moe")
    with pytest.raises(ValueError, match="outside"):
        MoE(config, Checkpoint(directory, torch.float32, CPU), PREFIX, CpuPlatform(CPU), experts=ExpertShard(6, 4))


def test_moe_layers_follow_each_familys_rule():
    deepseek = DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=3)
    assert [MoE.is_moe_layer(deepseek, i) for i in range(7)] == [False] * 3 + [True] * 4  # MTP layer 6 too
    qwen = Qwen3MoeConfig(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [MoE.is_moe_layer(qwen, i) for i in range(8)] == [False, True, False, False, False, True, False, True]
    assert [MoE.is_moe_layer(Qwen2MoeConfig(num_hidden_layers=3), i) for i in range(3)] == [True] * 3
    assert not MoE.is_moe_layer(Qwen2MoeConfig(num_experts=0), 0)
    assert not MoE.is_moe_layer(types.SimpleNamespace(model_type="llama"), 0)


# bfloat16 steps: expert choices can flip where bfloat16 rounds two scores together,
# so outputs are compared on the tokens whose experts agree with float32's.
BF16_BOUND = 2e-2


def routing_of(moe: MoE, h: torch.Tensor) -> torch.Tensor:
    logits = moe.gate(h.float() if moe.float32_router else h)
    return moe.platform.moe_select(logits, moe.routing)[1].sort(dim=-1).values


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe-renorm", "qwen2_moe"])
def test_bfloat16_stays_within_its_rounding_of_float32(saved, name):
    config, _, directory = saved(name)
    platform = CpuPlatform(CPU)
    exact = MoE(config, Checkpoint(directory, torch.float32, CPU), PREFIX, platform)
    rounded = MoE(config, Checkpoint(directory, torch.bfloat16, CPU), PREFIX, platform)
    if cpu_kernels.bfloat16_linear_available():  # the grouped kernel runs the experts
        assert isinstance(rounded.experts, GroupedCpuExperts)
    h = tokens(64)
    agree = (routing_of(exact, h) == routing_of(rounded, h.bfloat16())).all(dim=-1)
    assert agree.float().mean() >= 0.8
    ours, theirs = rounded(h.bfloat16()).float()[agree], exact(h)[agree]
    assert (ours - theirs).abs().max() <= BF16_BOUND * theirs.abs().max()


@pytest.mark.skipif(not cpu_kernels.bfloat16_linear_available(), reason="linear.c's bfloat16 kernels are not built")
def test_grouped_kernel_runs_each_expert_on_its_rows():
    """Experts without rows in between, rows past the last expert (another
    shard's) left 0; float32 sums rounded once, as F.linear in float32 then bfloat16."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(5, 48, 64, generator=generator).bfloat16()
    kernel = cpu_kernels.packed_grouped_linear(weights)
    counts = [3, 0, 17, 1, 9]
    x = torch.randn(sum(counts) + 4, 64, generator=generator).bfloat16()
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    out = kernel(x, offsets)
    for expert in range(5):
        rows = slice(int(offsets[expert]), int(offsets[expert + 1]))
        expected = torch.nn.functional.linear(x[rows].float(), weights[expert].float())
        torch.testing.assert_close(out[rows].float(), expected.bfloat16().float(), atol=0.07, rtol=8e-3)
    assert not out[sum(counts):].any()
    with pytest.raises(ValueError, match="offsets"):
        kernel(x, torch.tensor([0, 3, 2, 20, 21, 30]))


def test_bfloat16_experts_match_the_torch_reference_on_the_same_routing(saved):
    """The CPU platform's experts (the grouped kernel where built) against
    moe_ops.TorchExperts on the same bfloat16 weights and choices."""
    config, _, directory = saved("qwen3_moe-renorm")
    moe = MoE(config, Checkpoint(directory, torch.bfloat16, CPU), PREFIX, CpuPlatform(CPU))
    weights = Checkpoint(directory, torch.bfloat16, CPU)
    reference_experts = TorchExperts(*stacked_experts(weights, PREFIX, ExpertShard(0, config.num_experts)))
    h = tokens(64, dtype=torch.bfloat16)
    choice = moe.platform.moe_select(moe.gate(h), moe.routing)
    assert_close(moe.experts(h, *choice), reference_experts(h, *choice), 2e-2)


@pytest.mark.parametrize("shard", [None, ExpertShard(2, 3)])
def test_cuda_grouped_mm_experts_on_cpu_tensors(shard):
    """The CUDA platform's experts run torch's grouped GEMM, which torch 2.13
    also runs on CPU: what this proves is the offsets and operand layouts
    (the CUDA kernel itself never runs here)."""
    from services.worker.platforms.cuda import GroupedMmExperts

    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(8, 64, 64, generator=generator).bfloat16()
    down = torch.randn(8, 64, 32, generator=generator).bfloat16()
    x, ids = tokens(7, dtype=torch.bfloat16), torch.randint(0, 8, (7, 2), generator=generator)
    weights = torch.rand(7, 2, generator=generator)
    experts = range(8) if shard is None else range(shard.first, shard.first + shard.count)
    arguments = (gate_up[experts.start : experts.stop], down[experts.start : experts.stop], experts.start, 8)
    ours = GroupedMmExperts(*arguments)(x, weights, ids)
    assert_close(ours, TorchExperts(*arguments)(x, weights, ids), 1e-2)


class OpSpy:
    """The fake torch_npu, recording which ops were called."""

    def __init__(self, module):
        self._module, self.called = module, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self._module, name)


CHAIN = {"npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_unpermute"}


@pytest.mark.parametrize("count", [1, 7, 64])
@pytest.mark.parametrize("name", list(CASES))
def test_npu_op_chain_gives_the_cpu_platforms_output(saved, npu_platform, monkeypatch, name, count):
    """DeepSeek without renormalisation routes in torch (the op always renormalises sigmoid scores)."""
    config, _, directory = saved(name)
    spy = OpSpy(npu_platform._npu)
    monkeypatch.setattr(npu_platform, "_npu", spy)
    weights = Checkpoint(directory, torch.float32, CPU)
    h = tokens(count)
    ours = MoE(config, weights, PREFIX, npu_platform)(h)
    assert_close(ours, MoE(config, weights, PREFIX, CpuPlatform(CPU))(h), 1e-5)
    gating = {"npu_moe_gating_top_k"} if name != "deepseek_v3-no-renorm" else set()
    assert spy.called == CHAIN | gating


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen2_moe"])
def test_npu_expert_shards_sum_to_the_whole_block(saved, npu_platform, name):
    """Other shards' pairs (index -1 from init_routing) and the rows it leaves
    unwritten (NaN in the fake) count for nothing."""
    config, _, directory = saved(name)
    weights = Checkpoint(directory, torch.float32, CPU)
    num_experts = config.n_routed_experts if name == "deepseek_v3" else config.num_experts
    shards = [ExpertShard(0, 5), ExpertShard(5, num_experts - 5)]
    h = tokens(64)
    parts = [MoE(config, weights, PREFIX, npu_platform, experts=shard)(h) for shard in shards]
    assert_close(parts[0] + parts[1], MoE(config, weights, PREFIX, CpuPlatform(CPU))(h), 1e-5)
