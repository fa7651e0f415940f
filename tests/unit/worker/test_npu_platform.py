"""The NPU platform's plumbing, run on CPU through tests/fake_npu's torch_npu:
reference implementations of the Ascend ops under their real schemas, with
their layouts. What this proves: the worker calls those ops with the right keyword
names, layouts, index dtypes, cumulative/per-sequence lengths and mask, and
the bundled model gives the CPU platform's logits through them. What it does
not: anything about the real kernels (never run here)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform
from services.worker.sequence import SamplingParams
from tests.moe_models import FAMILIES, reference_model
from tests.unit.worker.block_tables import BlockTables
from tests.unit.worker.paged_oracle import assert_matches_sdpa

CPU = torch.device("cpu")


def test_without_torch_npu_npu_is_refused_and_auto_is_cpu(monkeypatch):
    from services.worker.platforms import select_platform

    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(RuntimeError, match="device=npu requested but torch_npu"):
        select_platform("npu")
    assert select_platform("auto").name == "cpu"  # no CUDA in this torch build either


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 128), (4, 4, 32, 256)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("decode_only", [False, True])
def test_fused_attention_matches_sdpa(npu_platform, heads, kv_heads, head_dim, block_size, window, decode_only):
    """Decodes, fresh prompts and a chunk over a cached prefix in one step, or
    decodes alone (the op's decode branch, which drops a window's band);
    blocks scattered over the pool; float32 so that layout mistakes cannot
    hide in rounding."""
    from services.worker.platforms.npu import NpuAttention

    torch.manual_seed(heads + block_size)
    kernel = NpuAttention(npu_platform._npu, heads, kv_heads, head_dim, block_size, CPU, scatter_cache_mode=True)
    new, computed = [1, 1, 1, 3, 21, 19, 150], [0, block_size - 1, block_size + 4, 0, 0, 30, 200]
    if decode_only:
        new, computed = new[:3], computed[:3]
    assert_matches_sdpa(kernel, heads, kv_heads, head_dim, block_size, 16, new=new, computed=computed,
                        window=window)


def test_kv_is_written_by_slot_where_the_scatter_op_has_no_cache_mode(npu_platform):
    """torch_npu before 26.0.0: npu_scatter_pa_kv_cache without cache_mode,
    which writes PA_NZ only (op-plugin's 7.3.0 schema)."""
    from services.worker.platforms.npu import NpuAttention, takes_cache_mode

    library = torch.library.Library("torch_npu_7_3", "FRAGMENT")
    library.define("npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                   "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
                   "Tensor? seq_lens=None) -> ()")
    old_scatter = torch.ops.torch_npu_7_3.npu_scatter_pa_kv_cache  # no kernel: calling it fails
    assert takes_cache_mode(torch.ops.npu.npu_scatter_pa_kv_cache) and npu_platform._scatter_cache_mode
    assert not takes_cache_mode(old_scatter)
    older_torch_npu = types.SimpleNamespace(
        npu_scatter_pa_kv_cache=old_scatter,
        npu_fused_infer_attention_score=npu_platform._npu.npu_fused_infer_attention_score)
    torch.manual_seed(1)
    kernel = NpuAttention(older_torch_npu, 4, 2, 32, 128, CPU, scatter_cache_mode=takes_cache_mode(old_scatter))
    assert_matches_sdpa(kernel, 4, 2, 32, 128, 8, new=[1, 19, 40], computed=[130, 0, 100], window=None)


def test_fused_attention_needs_its_block_sizes_and_dtypes(npu_platform):
    assert npu_platform.paged_attention(torch.bfloat16, 8, 2, 64, 128) is not None
    assert npu_platform.paged_attention(torch.bfloat16, 8, 2, 64, 512) is not None
    assert npu_platform.paged_attention(torch.bfloat16, 8, 2, 64, 16) is None  # SDPA instead
    assert npu_platform.paged_attention(torch.bfloat16, 8, 2, 64, 192) is None
    assert npu_platform.paged_attention(torch.float32, 8, 2, 64, 128) is None


def test_layer_ops_match_torch(npu_platform):
    from services.worker.platforms import TorchLayerOps

    ops = npu_platform.layer_ops(torch.float32, 96, 64, 64)
    torch.manual_seed(0)
    x, weight = torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), TorchLayerOps.rms_norm(x, weight, 1e-5))
    gate_up = torch.randn(5, 128)
    torch.testing.assert_close(ops.silu_mul(gate_up), TorchLayerOps.silu_mul(gate_up))
    qk = torch.randn(5, 12, 64)[:, 2:9]  # a strided view, as the decoder hands it
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(ops.rotate(qk, cos, sin), TorchLayerOps.rotate(qk, cos, sin))


def _logits(runner: ModelRunner, prompts: list[list[int]], decodes: list[list[int]] | None) -> list[torch.Tensor]:
    """A packed prefill of every prompt, then decode steps of all together,
    feeding `decodes` (one token per prompt per step), or the greedy tokens."""
    tables = BlockTables(runner)
    inputs = [tables.feed(i, p, 0, True, SamplingParams(temperature=0.0)) for i, p in enumerate(prompts)]
    logits = [runner.forward(inputs)]
    lengths = [len(p) for p in prompts]
    for step in range(4 if decodes is None else len(decodes)):
        tokens = logits[-1].argmax(dim=-1).tolist() if decodes is None else decodes[step]
        # Cloned: a replayed graph writes the next step's logits into the same memory.
        logits.append(runner.forward([tables.feed(i, [t], lengths[i], True) for i, t in enumerate(tokens)]).clone())
        lengths = [n + 1 for n in lengths]
    for i in range(len(prompts)):
        runner.release(i)
    return logits


def test_bundled_model_gives_the_cpu_platforms_logits(npu_platform, model_dir, monkeypatch):
    """bfloat16 (the fused attention's dtype), 128-token blocks (its block size):
    prompts that cross a block boundary, decodes after them, every path fed the
    float32 path's greedy tokens. Two bfloat16 paths round differently (the
    CPU's kernels, the reference ops), so each is held to the CPU platform's
    float32 logits: the NPU path must be within twice the CPU's own bfloat16
    path's distance to them (measured 0.11 against 0.067 on average: it rounds
    once more, adding the residual after each linear where the CPU fuses the
    add, and the CPU's 4-bit kernel for decode steps keeps float32 scales), and
    pick the same tokens wherever the choice is clear. A misread layout or
    length moves whole rows by several units. The NPU path is held to that
    twice: eagerly, and with its decode steps replayed from the fake's NPU
    graphs (three sequences padded to a graph of four)."""
    from services.worker.platforms.npu_graphs import NpuGraph

    prompts = [list(range(1000, 1130)), list(range(2000, 2007)), list(range(3000, 3060))]
    replays = []
    replay = NpuGraph.replay
    monkeypatch.setattr(NpuGraph, "replay", lambda graph, seq_lens: (replays.append(seq_lens), replay(graph, seq_lens)))

    def logits(platform, dtype: str, decodes: list[list[int]] | None, graphs: bool = False) -> list[torch.Tensor]:
        runner = ModelRunner(model_dir, platform, dtype, block_size=128, kv_cache_bytes=32 * 2**20,
                             max_batch_size=4, graph_capture=platform.graph_capture() if graphs else None)
        if platform is npu_platform:
            assert runner.attention_kernel is not None  # the fused path, not the SDPA fallback
        assert (runner.graphs is not None) == graphs
        return [step.float() for step in _logits(runner, prompts, decodes)]

    exact = logits(CpuPlatform(CPU), "float32", None)
    decodes = [step.argmax(dim=-1).tolist() for step in exact[:-1]]
    exact = torch.cat(exact)
    on_cpu = torch.cat(logits(CpuPlatform(CPU), "bfloat16", decodes))
    cpu_error = (on_cpu - exact).abs().mean()
    top2 = exact.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.5
    assert clear.sum() >= 3  # the prompts are arbitrary token runs: most choices are close
    for graphs in (False, True):
        on_npu = torch.cat(logits(npu_platform, "bfloat16", decodes, graphs))
        npu_error = (on_npu - exact).abs().mean()
        assert npu_error <= 2 * cpu_error, (graphs, npu_error, cpu_error)
        assert torch.equal(on_npu.argmax(dim=-1)[clear], exact.argmax(dim=-1)[clear]), graphs
    # Every decode step replayed, with its contexts and the padding's one row.
    assert replays == [[130 + i, 7 + i, 60 + i, 1] for i in range(1, len(decodes) + 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_families_give_the_cpu_platforms_logits(npu_platform, family, tmp_path):
    """Whole tiny MoE models (DeepSeek-V3's MLA and group-limited router,
    Qwen3-MoE, Qwen2-MoE's gated shared expert) through the NPU platform's
    routing, grouped-matmul and unpermute ops (the fake's reference ones), in
    float32: the CPU platform's logits, within float32 rounding."""
    reference_model(family, 256).save_pretrained(tmp_path)
    prompts = [list(range(10, 41)), list(range(100, 107))]

    def logits(platform) -> torch.Tensor:
        runner = ModelRunner(tmp_path, platform, "float32", block_size=4, kv_cache_bytes=2**20, max_batch_size=4)
        return torch.cat(_logits(runner, prompts, [[5, 6], [7, 8], [9, 10]]))

    torch.testing.assert_close(logits(npu_platform), logits(CpuPlatform(CPU)), atol=2e-4, rtol=2e-4)


# --- quantized linears (msModelSlim's W8A8, W8A8_DYNAMIC, and 4-bit weights) ---------------------------------


def _int8_weight(out_features: int, in_features: int, static: tuple[float, int] | None, seed: int):
    from services.worker.quantization import Int8Weight

    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = torch.rand(out_features, generator=generator) * 1e-3 + 1e-4
    return Int8Weight(q, scale, static, torch.bfloat16)


def test_dynamic_int8_linear_quantizes_each_token(npu_platform):
    """npu_dynamic_quant + npu_quant_matmul: each row's own int8 scale, the
    weight's per-row scale, the bias after both; the rows of x as bfloat16
    and in float64 the math msModelSlim's W8A8_DYNAMIC defines."""
    weight = _int8_weight(48, 64, None, 0)
    x = (torch.randn(5, 64) * torch.tensor([0.1, 1, 10, 100, 0.01])[:, None]).to(torch.bfloat16)
    bias = torch.randn(48)
    y = npu_platform.linear(weight, bias)(x, residual=torch.ones(5, 48, dtype=torch.bfloat16))
    xs = x.double()
    token_scale = xs.abs().amax(1, keepdim=True) / 127
    expected = ((xs / token_scale).round() @ weight.q.double().t()) * token_scale * weight.scale.double() + bias + 1
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


def test_static_int8_linear_takes_the_calibrated_scale_and_offset(npu_platform):
    """npu_quantize + npu_quant_matmul with deq_scale and an int32 bias that
    carries − offset · Σ weight and the float bias."""
    input_scale, input_offset = 2**-6, -7  # as a bfloat16 checkpoint holds them
    weight = _int8_weight(32, 64, (input_scale, input_offset), 1)
    deq = weight.scale.double()
    x = (torch.randn(6, 64) * 0.5).clamp(-1.8, 1.8).to(torch.bfloat16)  # within the calibrated range
    bias = torch.randn(32) * 0.01
    y = npu_platform.linear(weight, bias)(x)
    xq = (x.double() / input_scale + input_offset).round().clamp(-128, 127)
    q = weight.q.double()
    expected = (xq @ q.t() - input_offset * q.sum(1) + (bias.double() / deq).round()) * deq
    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
    # Against the float weight it stands for, the activations' rounding only.
    float_y = x.double() @ weight.dequantize().double().t() + bias
    assert (y.double() - float_y).abs().max() < 0.05 * float_y.abs().max()


def test_four_bit_linear_runs_on_weight_quant_batchmatmul(npu_platform):
    from services.worker.quantization import FourBitWeight

    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (32, 128), generator=generator, dtype=torch.uint8)
    scale = torch.rand(32, 4, generator=generator) * 0.01 + 1e-3
    low = -8 * scale + torch.randn(32, 4, generator=generator) * 1e-3
    weight = FourBitWeight(codes, scale, low, torch.bfloat16)
    linear = npu_platform.linear(weight, None)
    assert type(linear).__name__ == "NpuFourBitLinear"
    x = torch.randn(3, 128).to(torch.bfloat16)
    expected = x.double() @ weight.dequantize().double().t()
    torch.testing.assert_close(linear(x).double(), expected, rtol=2e-2, atol=2e-3)


def test_float32_runs_dequantize_quantized_weights(npu_platform):
    """The Ascend ops take float16/bfloat16 activations: a float32 run dequantizes."""
    import dataclasses

    weight = dataclasses.replace(_int8_weight(16, 32, None, 3), dtype=torch.float32)
    x = torch.randn(2, 32)
    torch.testing.assert_close(npu_platform.linear(weight, None)(x), x @ weight.dequantize().t())


def test_modelslim_w8a8_dynamic_model_gives_the_cpu_platforms_logits(npu_platform, tmp_path):
    """A tiny Qwen3-MoE written by our quantize command, in bfloat16 through the
    quantized Ascend matmuls (attention, the dense MLP and every expert): within
    the activations' int8 rounding of the CPU platform's float32 run of the
    weights the checkpoint stands for."""
    from services.worker.quantize import main as quantize_main

    reference_model("qwen3_moe", 256).save_pretrained(tmp_path / "float")  # layer 0 dense, 1 and 2 MoE
    assert quantize_main([str(tmp_path / "float"), str(tmp_path / "w8a8"), "--format", "w8a8_dynamic",
                          "--smooth-alpha", "-1"]) == 0  # no tokenizer to calibrate with
    prompts = [list(range(10, 41)), list(range(100, 107))]

    def logits(platform, dtype) -> torch.Tensor:
        runner = ModelRunner(tmp_path / "w8a8", platform, dtype, block_size=4, kv_cache_bytes=2**20,
                             max_batch_size=4)
        if platform is npu_platform:
            dense, moe = runner.decoder.layers[0], runner.decoder.layers[1].mlp.moe
            assert type(dense.attention.qkv).__name__ == type(dense.mlp.gate_up).__name__ == "NpuInt8Linear"
            assert {type(linear).__name__ for linear in moe.experts.gate_up + moe.experts.down} == {"NpuInt8Linear"}
        return torch.cat(_logits(runner, prompts, [[5, 6], [7, 8], [9, 10]])).float()

    exact = logits(CpuPlatform(CPU), "float32")
    on_npu = logits(npu_platform, "bfloat16")
    error = (on_npu - exact).abs().mean() / exact.abs().mean()
    assert error < 0.05, error
