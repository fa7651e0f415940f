"""A small random-weight DeepSeek-V3 (MLA, group-limited MoE, a dense first
layer, a shared expert) served end to end, beside a dense Llama of the same
active parameters per token, both through `make run`'s chain on the bundled
tokenizer: `bench.interleaved` at 1 and 32 streams, interleaved rounds,
medians of tokens/s, TTFT and ITL, and the ratios.

    PYTHONPATH=gen:. .venv/bin/python -m bench.moe_serving --rounds 4

No weights are downloaded: both models are built from configs (random
weights, fixed seed), so the figures measure the serving path, not answers."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, LlamaConfig

from services.common.model_files import default_model_path, resolve_model
from bench.interleaved import chains_side_by_side


def active_parameters(config) -> int:
    """Parameters a token runs through: all, less the routed experts it does not pick."""
    with torch.device("meta"):
        total = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if isinstance(config, DeepseekV3Config):
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        moe_layers = config.num_hidden_layers - config.first_k_dense_replace
        total -= moe_layers * (config.n_routed_experts - config.num_experts_per_tok) * per_expert
    return total


def build(directory: Path, config, tokenizer) -> int:
    """Save a random model of `config` with the bundled tokenizer; its active parameters per token."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return active_parameters(config)


def configs(args, vocab_size: int) -> tuple[DeepseekV3Config, LlamaConfig]:
    """The MoE model, and a dense Llama whose MLP width gives it as many active parameters."""
    common = dict(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, max_position_embeddings=4096, tie_word_embeddings=True)
    width = args.moe_intermediate * (args.top_k + 1)  # the active experts and the shared one
    moe = DeepseekV3Config(**common, num_key_value_heads=args.heads, intermediate_size=width,
                           moe_intermediate_size=args.moe_intermediate, n_routed_experts=args.experts,
                           n_shared_experts=1, num_experts_per_tok=args.top_k, n_group=4, topk_group=2,
                           first_k_dense_replace=1, q_lora_rank=args.hidden // 2, kv_lora_rank=args.hidden // 4,
                           qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    dense = dict(common, num_key_value_heads=max(1, args.heads // 4))
    narrowest = active_parameters(LlamaConfig(**dense, intermediate_size=1))
    per_unit = 3 * args.hidden * args.layers  # gate, up and down of every layer
    width = max(1, 1 + round((active_parameters(moe) - narrowest) / per_unit))
    return moe, LlamaConfig(**dense, intermediate_size=width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--levels", default="1:8,32:64", help="concurrency:requests, comma separated")
    parser.add_argument("--input-len", default="200")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--kv-cache-mib", default="512", help="each chain's KV pool (two run at once)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe-serving-"))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    moe_config, dense_config = configs(args, len(tokenizer))
    active = {name: build(work / name, config, tokenizer)
              for name, config in (("moe", moe_config), ("dense", dense_config))}
    print(f"active parameters per token: moe {active['moe'] / 1e6:.1f} M, dense {active['dense'] / 1e6:.1f} M",
          flush=True)
    envs = {name: {"STORMSERVE_MODEL_PATH": str(work / name), "STORMSERVE_KV_CACHE_MIB": args.kv_cache_mib}
            for name in active}
    chains_side_by_side(work, envs, "dense", args.levels, args.rounds, args.input_len, args.output_len)
    print(f"models and logs in {work}")


if __name__ == "__main__":
    main()
