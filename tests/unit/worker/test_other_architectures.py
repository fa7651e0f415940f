"""Any HF causal LM runs: tiny random models of several families give the same
logits paged as with stock HF attention. The Llama family (Llama, Mistral,
Qwen2, Qwen3) goes through the lean decoder, whose weights come straight from
the safetensors files (one, or shards), or from the loaded model for other
checkpoint formats; anything else (GPT-2 here: learned absolute positions, no
GQA, and dynamic NTK RoPE) through its own HF modules."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from services.worker.platforms import select_platform
from services.worker.decoder import LeanDecoder
from services.worker.model_runner import ModelRunner
from tests.unit.worker.block_tables import assert_schedule_matches

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama-bias-rope-scaling": lambda: LlamaConfig(
        **SMALL, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "mistral-sliding": lambda: MistralConfig(**SMALL, sliding_window=5),
    "qwen3-qk-norm": lambda: Qwen3Config(**SMALL, head_dim=32),
    "qwen2-sliding": lambda: Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        use_sliding_window=True, sliding_window=6, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
    "llama-dynamic-rope": lambda: LlamaConfig(
        **SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256),
}
HF_MODULES = ("gpt2", "llama-dynamic-rope")


def _saved(model: torch.nn.Module, directory: Path, checkpoint_format: str) -> Path:
    if checkpoint_format == "pytorch_model.bin":  # no safetensors: loaded through transformers
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        model.save_pretrained(directory, max_shard_size="100KB" if checkpoint_format == "shards" else "50GB")
        assert (directory / "model.safetensors.index.json").exists() == (checkpoint_format == "shards")
    return directory


@pytest.mark.parametrize(("name", "checkpoint_format"), [(name, "safetensors") for name in sorted(CONFIGS)] + [
    ("qwen2-sliding", "shards"), ("llama-bias-rope-scaling", "pytorch_model.bin")])
def test_tiny_model_paged_matches_hf(name: str, checkpoint_format: str, tmp_path: Path):
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    runner = ModelRunner(_saved(reference, tmp_path, checkpoint_format), select_platform("cpu"), "float32",
                         block_size=4, kv_cache_bytes=2**20, max_batch_size=8)

    assert isinstance(runner.decoder, LeanDecoder) == (name not in HF_MODULES)

    tokens = {1: torch.randint(0, VOCAB, (23,)).tolist(), 2: torch.randint(0, VOCAB, (15,)).tolist()}
    with torch.inference_mode():
        expected = {s: reference(torch.tensor([t])).logits[0] for s, t in tokens.items()}
    # seq 1: prefill 10, then 9 more on top of the cache (crosses the window), then decodes.
    assert_schedule_matches(runner, expected, tokens)
