"""MLA (services/worker/mla.py) over a real latent KVCachePool and PagedStep,
held to transformers' DeepseekV3Attention run on each whole sequence with a
causal mask: tiny random DeepSeek-V3 models in float32 (eager attention),
saved and read back through Checkpoint, with interleaved and rotate-half
rope, yarn (mscale_all_dim) and default rope, q_lora_rank set and None.
The fake-NPU path (tests/fake_npu's reference ops under their real schemas)
is held to the torch path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV3ForCausalLM

from services.worker.attention import PagedStep, build_paged_step
from services.worker.checkpoint import Checkpoint
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.mla import MlaAttention, softmax_scale
from services.worker.parallel import HeadShard
from services.worker.platforms.cpu import CpuPlatform
from services.worker.rotary import Rotary, StepRope

CPU = torch.device("cpu")
FAKE_NPU = Path(__file__).resolve().parents[2] / "fake_npu"
BLOCK_SIZE = 4
NUM_BLOCKS = 96
LAYER = 1  # the second layer: its own slice of the pool
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _config(rope_interleave: bool, q_lora_rank: int | None, rope_parameters: dict, **sizes) -> DeepseekV3Config:
    shape = dict(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=12) | sizes
    return DeepseekV3Config(
        vocab_size=32, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=2,
        num_key_value_heads=shape["num_attention_heads"], n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, q_lora_rank=q_lora_rank, max_position_embeddings=256, rope_interleave=rope_interleave,
        rope_parameters=dict(rope_parameters), attn_implementation="eager", **shape,
    )


class Model:
    """A tiny DeepSeek-V3 saved to disk, its layer LAYER's HF attention and our MLA of it."""

    def __init__(self, config: DeepseekV3Config, directory: Path):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).eval()
        with torch.no_grad():  # sharper than the init's 0.02: attention far from uniform
            for name, parameter in model.model.layers[LAYER].self_attn.named_parameters():
                noise = torch.randn_like(parameter)
                parameter.copy_(1 + 0.2 * noise if "layernorm" in name else 0.25 * noise)
        model.save_pretrained(directory)
        self.config = config
        self.hf_attention = model.model.layers[LAYER].self_attn
        self.hf_rotary = model.model.rotary_emb
        self.weights = Checkpoint(directory, torch.float32, CPU)

    def mla(self, **options) -> MlaAttention:
        return MlaAttention(self.config, self.weights, LAYER, CpuPlatform(CPU), **options)

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """HF's attention output over the whole sequence x [L, hidden]."""
        length = x.shape[0]
        cos_sin = self.hf_rotary(x[None], torch.arange(length)[None])
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        return self.hf_attention(x[None], cos_sin, mask)[0][0]


CASES = {
    "interleave-q_lora-yarn": (True, 24, YARN),
    "rotate_half-q_lora-yarn": (False, 24, YARN),
    "interleave-q_proj-yarn": (True, None, YARN),
    "rotate_half-q_proj-default": (False, None, DEFAULT_ROPE),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def model(request, tmp_path_factory) -> Model:
    return Model(_config(*CASES[request.param]), tmp_path_factory.mktemp(request.param))


class Sequences:
    """Random hidden states and residuals per sequence, the scheduler's part
    (block tables over scattered blocks of one latent pool), and the steps."""

    def __init__(self, model: Model, lengths: dict[int, int], block_size: int = BLOCK_SIZE):
        generator = torch.Generator().manual_seed(sum(lengths.values()))
        hidden = model.config.hidden_size
        self.model = model
        self.inputs = {s: torch.randn(n, hidden, generator=generator) for s, n in lengths.items()}
        self.residuals = {s: torch.randn(n, hidden, generator=generator) for s, n in lengths.items()}
        self.block_size = block_size
        spec = KVCacheSpec.from_model_config(model.config, block_size, torch.float32)
        self.pool = KVCachePool(spec, NUM_BLOCKS, CPU)
        self.free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
        self.tables: dict[int, list[int]] = {}

    def layout(self, rows: list[tuple[int, int, int]]) -> tuple[PagedStep, torch.Tensor, torch.Tensor]:
        """A packed step of (seq, num_computed, num_new), its hidden states and residuals."""
        for seq, computed, new in rows:
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < computed + new:
                table.append(self.free.pop())
        paged = build_paged_step(self.pool, [n for _, _, n in rows], [c for _, c, _ in rows],
                                 [self.tables[s] for s, _, _ in rows], CPU)
        hidden = torch.cat([self.inputs[s][c : c + n] for s, c, n in rows])
        residual = torch.cat([self.residuals[s][c : c + n] for s, c, n in rows])
        return paged, hidden, residual

    def step(self, mla: MlaAttention, rows: list[tuple[int, int, int]], step_rope: bool = False
             ) -> dict[int, torch.Tensor]:
        """One packed step -> each sequence's rows of o_proj(attention) + residual;
        `step_rope`: the rotary table through decoder.StepRope."""
        paged, hidden, residual = self.layout(rows)
        with torch.no_grad():
            heads = mla(hidden, paged, StepRope(paged.positions, hidden.dtype) if step_rope else None)
            out = mla.o_proj(heads, residual=residual)
        return dict(zip([s for s, _, _ in rows], out.split([n for _, _, n in rows])))

    def expected(self, seq: int, computed: int, new: int) -> torch.Tensor:
        full = self.model.reference(self.inputs[seq])
        return (self.residuals[seq] + full)[computed : computed + new]

    def check(self, outputs: dict[int, torch.Tensor], rows: list[tuple[int, int, int]]) -> None:
        for seq, computed, new in rows:
            expected = self.expected(seq, computed, new)
            # float32 rounding: relative to the largest output (the sums behind each are as large)
            torch.testing.assert_close(outputs[seq], expected, rtol=1.3e-6, atol=1e-5 * float(expected.abs().max()))


def test_packed_prefills(model: Model):
    """Fresh prompts packed into one step (one of a single token: a decode with no prefix)."""
    sequences = Sequences(model, {0: 7, 1: 13, 2: 1})
    rows = [(0, 0, 7), (1, 0, 13), (2, 0, 1)]
    sequences.check(sequences.step(model.mla(), rows), rows)


def test_chunk_over_a_cached_prefix(model: Model):
    """The prefix's latent written by an earlier step into scattered blocks."""
    sequences = Sequences(model, {0: 20, 1: 9})
    mla = model.mla()
    first = [(0, 0, 11), (1, 0, 5)]
    sequences.check(sequences.step(mla, first), first)
    second = [(0, 11, 9), (1, 5, 4)]
    sequences.check(sequences.step(mla, second, step_rope=True), second)


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_decodes_at_different_context_lengths_with_a_prefill_in_the_step(model: Model, absorbed: bool):
    lengths = {0: 3, 1: 10, 2: 17, 3: 6}
    sequences = Sequences(model, lengths)
    mla = model.mla(absorbed_decode=absorbed)
    sequences.step(mla, [(s, 0, lengths[s] - 2) for s in (0, 1, 2)])
    for computed in (1, 2):  # two decode steps each; the last one alongside seq 3's prompt
        rows = [(s, lengths[s] - 3 + computed, 1) for s in (0, 1, 2)] + ([(3, 0, 6)] if computed == 2 else [])
        sequences.check(sequences.step(mla, rows), rows)


def test_drafted_rows(model: Model):
    """A decode and its 3 drafted tokens: one sequence with 4 new rows over its context."""
    sequences = Sequences(model, {0: 15, 1: 8})
    mla = model.mla()
    sequences.step(mla, [(0, 0, 11), (1, 0, 7)])
    rows = [(1, 7, 1), (0, 11, 4)]
    sequences.check(sequences.step(mla, rows), rows)


def test_absorbed_decode_equals_expanded_decode(model: Model):
    lengths = {0: 5, 1: 23, 2: 2}
    runs = {}
    for absorbed in (True, False):
        sequences = Sequences(model, lengths)
        mla = model.mla(absorbed_decode=absorbed)
        sequences.step(mla, [(s, 0, n - 1) for s, n in lengths.items()])
        runs[absorbed] = sequences.step(mla, [(s, n - 1, 1) for s, n in lengths.items()])
    for seq in lengths:
        torch.testing.assert_close(runs[True][seq], runs[False][seq], rtol=1e-5, atol=1e-5)


def test_head_shards_sum_to_the_whole_layer(tmp_path):
    """Tensor parallelism's split, 1 and 3 of 4 heads, with biases (attention_bias):
    each shard caches the whole latent; the o_proj partial sums, the residual and
    bias added by the shard with head 0 alone, make the whole layer's output."""
    model = Model(_config(True, 24, YARN, attention_bias=True), tmp_path)
    assert "model.layers.1.self_attn.o_proj.bias" in model.weights
    whole = model.mla()
    shards = [model.mla(head_shard=HeadShard(0, 0, 0, 1)), model.mla(head_shard=HeadShard(0, 0, 1, 3))]
    sequences = Sequences(model, {0: 9, 1: 5})
    for rows in ([(0, 0, 6), (1, 0, 4)], [(0, 6, 3), (1, 4, 1)]):
        paged, hidden, residual = sequences.layout(rows)
        with torch.no_grad():
            expected = whole.o_proj(whole(hidden, paged), residual=residual)
            parts = [shard.o_proj(shard(hidden, paged), residual=residual if shard is shards[0] else None)
                     for shard in shards]
        torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)
        outputs = dict(zip([s for s, _, _ in rows], expected.split([n for _, _, n in rows])))
        sequences.check(outputs, rows)


def test_softmax_scale_and_rotary_are_transformers():
    config = _config(True, 24, YARN)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    assert softmax_scale(config) == pytest.approx(yarn_apply_mscale(config.rope_parameters, 24 ** -0.5), rel=1e-12)
    assert softmax_scale(config) != pytest.approx(24 ** -0.5)
    positions = torch.arange(300)
    ours = Rotary(config, config.qk_rope_head_dim)(positions, torch.float32)
    theirs = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    torch.testing.assert_close(ours, tuple(t[0] for t in theirs), rtol=0, atol=0)


# --- the latent pool -----------------------------------------------------------------------------------


def test_deepseek_v3_caches_one_latent_per_token_and_layer():
    """DeepSeek-V3's shape: 61 layers, 128 heads, a 512 + 64 latent, bfloat16."""
    spec = KVCacheSpec.from_model_config(DeepseekV3Config(), 128, torch.bfloat16)
    assert (spec.num_kv_heads, spec.head_dim, spec.latent.kv_lora_rank, spec.latent.rope_dim) == (1, 576, 512, 64)
    assert spec.bytes_per_token == 61 * 576 * 2 == 70_272
    assert spec.bytes_per_block == 128 * 70_272
    assert spec.latent.per_head_values == 128 * (128 + 64 + 128)  # K/V per head: 4,997,120 bytes per token
    with pytest.raises(ValueError, match="one latent"):  # a tensor-parallel head split must not apply
        KVCacheSpec(61, 8, 576, 128, torch.bfloat16, spec.latent)


def test_latent_pool_logs_its_size_and_copies_blocks(caplog):
    spec = KVCacheSpec.from_model_config(_config(True, 24, YARN), 3, torch.float32)
    with caplog.at_level("INFO", logger="services.worker.kv_cache"):
        pool = KVCachePool(spec, 4, CPU)
    assert pool.caches == (pool.latent_cache, pool.rope_cache) and not hasattr(pool, "key_cache")
    assert pool.latent_cache.shape == (2, 12, 32) and pool.rope_cache.shape == (2, 12, 8)
    assert "12 tokens, 0.0 MiB, 320 bytes per token" in caplog.text  # 2 layers x (32 + 8) values x 4 bytes
    # 4 heads x (16 + 8 + 12) values; the pool's memory would hold 3 of those tokens.
    assert "would take 144 values per token and layer, 1152 bytes per token (3.6 times" in caplog.text
    assert "3 tokens in this pool's memory" in caplog.text
    for sign, cache in enumerate(pool.caches):
        cache.copy_((-1) ** sign * torch.arange(cache.numel(), dtype=torch.float32).view(cache.shape))
    before = [cache.clone() for cache in pool.caches]
    pool.copy_blocks([(0, 1), (1, 0), (0, 3)])
    for cache, old in zip(pool.caches, before):
        torch.testing.assert_close(cache[:, 3:6], old[:, 0:3])
        torch.testing.assert_close(cache[:, 0:3], old[:, 3:6])
        torch.testing.assert_close(cache[:, 9:12], old[:, 0:3])


def test_other_latent_attentions_are_refused():
    config = DeepseekV2Config(kv_lora_rank=32, q_lora_rank=None, num_hidden_layers=1)
    with pytest.raises(ValueError, match="'deepseek_v2' models is not supported"):
        KVCacheSpec.from_model_config(config, 16, torch.float32)


# --- the fake-NPU path ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_npu():
    """tests/fake_npu's torch_npu; it stays imported (its ops registered)."""
    sys.path.insert(0, str(FAKE_NPU))
    try:
        import torch_npu

        yield torch_npu
    finally:
        sys.path.remove(str(FAKE_NPU))


@pytest.fixture(scope="module")
def real_latent_model(tmp_path_factory) -> Model:
    """The latent the Ascend ops take (512 + 64), small elsewhere."""
    config = _config(True, 24, YARN, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=8)
    return Model(config, tmp_path_factory.mktemp("real_latent"))


def test_fake_npu_path_equals_the_torch_path(torch_npu, real_latent_model: Model):
    """Packed prompts, a chunk over a prefix, drafted rows and absorbed decodes
    (the op's block tables read off the gathered layout) in 16-token blocks."""
    from services.worker.platforms.npu import NpuMlaOps

    lengths = {0: 30, 1: 9, 2: 21, 3: 2}
    plan = [[(0, 0, 17), (1, 0, 8), (2, 0, 20), (3, 0, 1)],
            [(0, 17, 9), (1, 8, 1), (2, 20, 1), (3, 1, 1)],
            [(0, 26, 4)]]
    runs = {}
    for name, ops in (("torch", None), ("npu", NpuMlaOps(torch_npu, 16))):
        sequences = Sequences(real_latent_model, lengths, block_size=16)
        mla = real_latent_model.mla(ops=ops)
        runs[name] = ([sequences.step(mla, rows) for rows in plan], sequences.pool)
        sequences.check(runs[name][0][-1], plan[-1])
    for torch_step, npu_step in zip(runs["torch"][0], runs["npu"][0]):
        for seq in torch_step:
            torch.testing.assert_close(npu_step[seq], torch_step[seq], rtol=1e-5, atol=1e-5)
    for torch_cache, npu_cache in zip(runs["torch"][1].caches, runs["npu"][1].caches):
        torch.testing.assert_close(npu_cache, torch_cache, rtol=1e-5, atol=1e-5)


def test_npu_platform_takes_the_fused_ops_where_they_fit(torch_npu):
    from services.worker.platforms.npu import NpuMlaOps, NpuPlatform

    platform = NpuPlatform(CPU)
    v3 = KVCacheSpec.from_model_config(DeepseekV3Config(), 128, torch.bfloat16)
    assert isinstance(platform.mla_ops(v3, 16), NpuMlaOps)
    assert platform.mla_ops(v3, 12) is None  # the op takes powers of two
    assert platform.mla_ops(KVCacheSpec.from_model_config(DeepseekV3Config(), 128, torch.float32), 16) is None
    assert platform.mla_ops(KVCacheSpec.from_model_config(DeepseekV3Config(), 16, torch.bfloat16), 16) is None
    small = KVCacheSpec.from_model_config(_config(True, 24, YARN), 128, torch.bfloat16)
    assert platform.mla_ops(small, 4) is None
