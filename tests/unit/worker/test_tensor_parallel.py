"""Tensor parallelism on CPU: rank 0 in this process, rank 1 a real follower
process (python -m services.worker.follower) over gloo. The group's
log-probs (logits, normalised) must be the single process's within float32
rounding, for a packed prefill, a chunked prefill and decodes: on the bundled
model (lean path; its 3 KV-head groups split 2 and 1, MLP and vocabulary in
halves), on tiny random models that take the lean path's other branches, and
on models that run their own HF modules, split in place."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GemmaConfig, GPT2Config, LlamaConfig, Qwen3Config

from services.common.config import load_config
from services.common.errors import ServiceError
from services.worker.config import WorkerConfig
from services.worker.decoder import LeanDecoder, MoeMlp
from services.worker.follower import build_runner
from services.worker.guided import GrammarSpec
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel, balanced_range
from services.worker.platforms import base as platforms_base, select_platform
from services.worker.sequence import SamplingParams
from tests.moe_models import FAMILIES, reference_model
from tests.unit.worker.block_tables import BlockTables

# Odd: the vocabulary splits into two unequal halves, the second padded.
VOCAB = 251
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY = {
    # The lean path's branches the bundled model leaves out: Q/K/V and o_proj
    # biases (o_proj's added by rank 0 alone), per-head q/k norms, head_dim
    # other than hidden / heads, an lm_head of its own.
    "qwen3-bias-untied": lambda: Qwen3Config(**SMALL, head_dim=32, attention_bias=True, tie_word_embeddings=False),
    # HF modules: Llama's with a RoPE the lean path does not take; Gemma's
    # (GELU MLP, a scaled embedding module, tied lm_head).
    "llama-dynamic-rope": lambda: LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "gemma": lambda: GemmaConfig(**SMALL, head_dim=16),
}


@pytest.mark.parametrize(("num_threads", "num_ranks", "expected"),
                         [(0, 1, 6), (4, 1, 4), (0, 2, 3), (0, 4, 1), (5, 2, 2), (1, 2, 1), (0, 8, 1)])
def test_the_ranks_of_a_worker_share_its_threads(num_threads, num_ranks, expected, monkeypatch):
    set_to = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(platforms_base, "usable_cpus", lambda: 6)
    select_platform("cpu").set_num_threads(num_threads, num_ranks)
    assert (set_to or [torch.get_num_threads()]) == [expected]


def test_balanced_ranges_cover_everything_once():
    for total, parts in [(3, 2), (9, 4), (1536, 2), (7, 7)]:
        ranges = [balanced_range(total, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


@contextmanager
def _group(model_path: Path | str) -> Iterator[ModelRunner]:
    """Rank 0's runner of a two-rank group over `model_path`."""
    config = load_config(WorkerConfig, environ={}, argv=[
        "--model-path", str(model_path), "--device", "cpu", "--dtype", "float32", "--cache-block-size", "4",
        "--kv-cache-mib", "16", "--max-batch-size", "8", "--tensor-parallel-size", "2", "--num-threads", "1"])
    platform = select_platform("cpu")
    group = TensorParallel.start(config, platform)
    try:
        yield build_runner(config, platform, group)
    finally:
        group.close()


def _logprobs(runner: ModelRunner, sequences: list[list[int]], top: int) -> list[dict[int, float]]:
    """Each sequence's first 31, 5 and 23 tokens are its prompt: the first two
    prefilled together beside the third's first 9, the third's rest as a chunk
    over that cached prefix; then 6 decode steps of all three, fed the
    sequences' next tokens. Per sampled row: {token id: log-prob} of its `top`."""
    tables = BlockTables(runner)
    params = SamplingParams(temperature=0.0, top_logprobs=top)
    lengths = [31, 5, 23]
    steps = [[tables.feed(0, sequences[0][:31], 0, True, params), tables.feed(1, sequences[1][:5], 0, True, params),
              tables.feed(2, sequences[2][:9], 0, False, params)],
             [tables.feed(2, sequences[2][9:23], 9, True)]]
    for k in range(6):
        steps.append([tables.feed(i, [sequences[i][n + k]], n + k, True) for i, n in enumerate(lengths)])
    rows = []
    for step in steps:
        rows.extend({t.token_id: t.logprob for t in token.top_logprobs} for token in runner.step(step).tokens)
    runner.step([], release_seq_ids=[0, 1, 2])
    return rows


def _assert_same_logprobs(together: list[dict[int, float]], alone: list[dict[int, float]], top: int) -> None:
    assert len(together) == len(alone) == 3 * 7
    for a, b in zip(together, alone):
        shared = a.keys() & b.keys()
        assert len(shared) >= 0.9 * top  # the same top tokens, but for near-ties at the edge
        for token in shared:
            assert a[token] == pytest.approx(b[token], abs=1e-4)


def test_two_ranks_give_one_ranks_logprobs(runner, model_dir):
    sequences = [list(range(700, 737)), list(range(900, 911)), list(range(1200, 1229))]
    with _group(model_dir) as group_runner:
        assert group_runner.kv_pool.spec.num_kv_heads == 2  # rank 0's two of three KV-head groups
        together = _logprobs(group_runner, sequences, 50)
    _assert_same_logprobs(together, _logprobs(runner, sequences, 50), 50)


def _tiny_model(config, directory: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():  # biases and norms too, which transformers starts at 0 and 1
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", sorted(TINY))
def test_two_ranks_of_tiny_models_give_one_ranks_logprobs(name: str, tmp_path: Path):
    """Every token's log-prob (the whole vocabulary)."""
    model_path = _tiny_model(TINY[name](), tmp_path)
    sequences = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)).tolist()
    alone = ModelRunner(model_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=16 * 2**20,
                        max_batch_size=8)
    with _group(model_path) as group_runner:
        assert isinstance(group_runner.decoder, LeanDecoder) == name.startswith("qwen3")
        assert group_runner.kv_pool.spec.num_kv_heads == 1
        together = _logprobs(group_runner, sequences, VOCAB)
    _assert_same_logprobs(together, _logprobs(alone, sequences, VOCAB), VOCAB)


def test_two_ranks_of_a_quantized_checkpoint_give_one_ranks_logprobs(tmp_path: Path):
    """DeepSeek-style FP8 blocks (partial at the edges): each rank splits the
    weights the blocks and their scales stand for."""
    from safetensors.torch import load_file

    from tests import quantized_models

    source = _tiny_model(TINY["qwen3-bias-untied"](), tmp_path / "float")
    stored, _, config = quantized_models.fp8_blocks(load_file(source / "model.safetensors"), block=48)
    model_path = quantized_models.write(tmp_path / "fp8", source, stored, quantization=config)
    sequences = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)).tolist()
    alone = ModelRunner(model_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=16 * 2**20,
                        max_batch_size=8)
    with _group(model_path) as group_runner:
        together = _logprobs(group_runner, sequences, VOCAB)
    _assert_same_logprobs(together, _logprobs(alone, sequences, VOCAB), VOCAB)


def test_two_ranks_of_a_static_w8a8_checkpoint_run_their_int8_shards(tmp_path: Path):
    """msModelSlim W8A8 with calibrated (fixed) input scales: each rank runs its
    rows of Q/K/V and gate/up and its input columns of o_proj and down on the
    integer kernels, the offset's share of each partial sum its own and the
    biases on rank 0; static activations quantize alike on both ranks, so the
    group gives one rank's log-probs."""
    from safetensors.torch import load_file

    from services.worker import int8_kernels
    from tests import quantized_models

    if not int8_kernels.int8_linear_available():
        pytest.skip("int8.c's kernels are not built here")
    # MLP rows split in halves of 64: whole groups of 32 inputs for down's kernel.
    config = Qwen3Config(**{**SMALL, "intermediate_size": 128}, head_dim=32, attention_bias=True,
                         tie_word_embeddings=False)
    source = _tiny_model(config, tmp_path / "float")
    stored, description = quantized_models.modelslim_w8a8_static(load_file(source / "model.safetensors"))
    model_path = quantized_models.write(tmp_path / "w8a8", source, stored, description=description)
    sequences = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)).tolist()
    alone = ModelRunner(model_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=16 * 2**20,
                        max_batch_size=8)
    with _group(model_path) as group_runner:
        layer = group_runner.decoder.layers[1]
        assert all(isinstance(linear, int8_kernels.QuantizedLinear)
                   for linear in (layer.attention.qkv, layer.mlp.gate_up))
        together = _logprobs(group_runner, sequences, VOCAB)
    _assert_same_logprobs(together, _logprobs(alone, sequences, VOCAB), VOCAB)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_of_moe_models_split_experts_and_give_one_ranks_logprobs(family: str, tmp_path: Path):
    """Expert parallelism: each rank runs half the routed experts (the shared
    ones on rank 0) for every token, one all-reduce sums them; attention by
    heads (DeepSeek's latent cached whole on both ranks)."""
    reference_model(family, VOCAB).save_pretrained(tmp_path)
    sequences = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1)).tolist()
    alone = ModelRunner(tmp_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=16 * 2**20,
                        max_batch_size=8)
    with _group(tmp_path) as group_runner:
        assert isinstance(group_runner.decoder, LeanDecoder)
        moe = [layer.mlp.moe for layer in group_runner.decoder.layers if isinstance(layer.mlp, MoeMlp)]
        assert moe and all(m.experts.num_local < m.experts.num_experts for m in moe)
        assert group_runner.kv_pool.spec == alone.kv_pool.spec or family != "deepseek_v3"
        together = _logprobs(group_runner, sequences, VOCAB)
    _assert_same_logprobs(together, _logprobs(alone, sequences, VOCAB), VOCAB)


class _Unjoined(TensorParallel):
    """Rank 0 of a group that never forms: what ModelRunner checks before its
    first collective (a collective would fail: there is no process group)."""

    def __init__(self, world_size: int):
        self.rank, self.world_size = 0, world_size


def test_a_model_it_cannot_split_is_refused(tmp_path: Path):
    """GPT-2's fused c_attn and learned positions follow no rule of the split."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tensor parallelism cannot split transformer\.\S+"):
        ModelRunner(tmp_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                    max_batch_size=2, tensor_parallel=_Unjoined(2))


def test_fewer_kv_heads_than_ranks_is_refused(model_dir):
    with pytest.raises(ValueError, match="3 cannot go to 4 ranks"):
        ModelRunner(model_dir, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                    max_batch_size=2, tensor_parallel=_Unjoined(4))


def test_a_sequence_refused_for_its_grammar_never_reaches_the_other_ranks(runner, monkeypatch):
    """A grammar compiles when its sequence first runs: a sequence refused for
    one must be left out before rank 0 sends the step, or the followers would
    run a forward over a sequence rank 0 dropped; a step refused whole is
    never sent."""
    led: list[list[int]] = []

    class Recorder:
        def lead(self, inputs, block_copies):
            led.append([s.seq_id for s in inputs])

    monkeypatch.setattr(runner, "tensor_parallel", Recorder())
    tables = BlockTables(runner)
    free = SamplingParams(temperature=0.0)
    broken = SamplingParams(temperature=0.0, grammar=GrammarSpec("json_schema", "{not json"))
    result = runner.step([tables.feed(1, [1, 2, 3], 0, True, free), tables.feed(2, [4, 5], 0, True, broken)])
    assert led == [[1]] and 2 not in runner.sequences
    assert [r.seq_id for r in result.refused] == [2] and "not valid JSON" in result.refused[0].message
    with pytest.raises(ServiceError, match="appears twice"):
        runner.step([tables.feed(3, [1], 0, True, free)] * 2)
    assert led == [[1]] and 3 not in runner.sequences
    runner.step([], release_seq_ids=[1, 2])
