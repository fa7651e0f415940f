"""Tiny random-weight mixture-of-experts models of the families the lean path
serves (DeepSeek-V3/R1: MLA and group-limited MoE; Qwen3-MoE; Qwen2-MoE),
saved as HF directories the services load like any other: the bundled SmolLM2
tokenizer (with DeepSeek's tool markers for deepseek_v3), a chat template in
the family's style, and float32 weights from a fixed seed. No weights of these
families can be downloaded here.

DeepSeek's MTP layer (`num_nextn_predict_layers`) is written as DeepSeek
publishes it (README_WEIGHTS.md: `model.layers.<num_hidden_layers>.` with
`enorm`, `hnorm`, `eh_proj`, one decoder layer and `shared_head`), which
transformers drops on load."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, Qwen2MoeConfig, Qwen3MoeConfig

from services.common.model_files import default_model_path, resolve_model

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe")
# DeepSeek-V3's tool-call markers: special tokens of its tokenizer.
DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")

# R1's template opens the think block in the prompt; tools are listed for the model.
R1_TEMPLATE = (
    "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<｜User｜>{{ message.content }}"
    "{% elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content or '' }}<｜end▁of▁sentence｜>"
    "{% elif message.role == 'tool' %}<｜tool▁output▁begin｜>{{ message.content }}<｜tool▁output▁end｜>"
    "{% else %}{{ message.content }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
# Qwen3's ChatML with its <think> switch and hermes-style tools.
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6)


def family_config(family: str, vocab_size: int, **overrides):
    """A tiny config of `family` (one of FAMILIES)."""
    if family == "deepseek_v3":
        return DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4, "n_routed_experts": 16,
                                   "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                   "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "q_lora_rank": 32,
                                   "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                                   "v_head_dim": 16, "vocab_size": vocab_size, **overrides})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{**SMALL, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                                 "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                                 "mlp_only_layers": [0], "vocab_size": vocab_size, **overrides})
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**{**SMALL, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
                                 "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1,
                                 "vocab_size": vocab_size, **overrides})
    raise ValueError(f"unknown family {family!r}")


def _random_bias(model) -> None:
    """DeepSeek's selection bias is zero when a model is built from a config:
    biased selection would never be exercised."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand_like(buffer) * 0.5)


def _add_mtp_layer(directory: Path, config, seed: int) -> None:
    """DeepSeek's MTP module as the published checkpoints hold it: a copy of
    a decoder layer under the next layer index, with its extra tensors."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    last, mtp = config.num_hidden_layers - 1, config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in list(tensors.items()):
        prefix = f"model.layers.{last}."
        if name.startswith(prefix):
            noise = torch.randn(tensor.shape, generator=generator) * 0.02
            tensors[f"model.layers.{mtp}." + name[len(prefix):]] = (tensor + noise).contiguous()
    hidden = config.hidden_size
    tensors[f"model.layers.{mtp}.enorm.weight"] = torch.ones(hidden)
    tensors[f"model.layers.{mtp}.hnorm.weight"] = torch.ones(hidden)
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.05
    tensors[f"model.layers.{mtp}.shared_head.norm.weight"] = torch.ones(hidden)
    save_file(tensors, path, metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**saved, "num_nextn_predict_layers": 1}, indent=2))


def stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named as checkpoints hold experts (one by one) renamed and stacked as
    transformers' modules hold them: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    state = dict(state)
    prefixes = sorted({k[: k.index(".experts.") + len(".experts.")] for k in state if ".experts.0." in k})
    for prefix in prefixes:
        count = len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat([state.pop(f"{prefix}{e}.{n}_proj.weight")
                                                                 for n in ("gate", "up")]) for e in range(count)])
        state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(count)])
    return state


def reference_model(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny `family` model in transformers' own eager float32 modules (the reference)."""
    config = family_config(family, vocab_size, **overrides)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        _random_bias(model)
    return model


def build_moe(family: str, directory: Path, seed: int = 0, mtp: bool = False, **overrides) -> Path:
    """Write a tiny `family` model to `directory`; returns it. `mtp`: with a
    DeepSeek MTP layer (deepseek_v3 only)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    if family == "deepseek_v3":
        tokenizer.add_special_tokens({"additional_special_tokens": [
            *DEEPSEEK_MARKERS, "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]})
        tokenizer.chat_template = R1_TEMPLATE
    else:
        tokenizer.chat_template = QWEN3_TEMPLATE if family == "qwen3_moe" else QWEN2_TEMPLATE
    model = reference_model(family, len(tokenizer), seed, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, **overrides)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if mtp:
        _add_mtp_layer(directory, model.config, seed)
    return directory
