"""One MLA layer of DeepSeek-V3's shape decoding over a long context: the
absorbed form (services/worker/mla.py: attention in latent space, W_UK and
W_UV folded into the query and the output) against the expanded form
(kv_b_proj over the whole context each step, then attention per head), in
interleaved rounds; median and p90 ms per layer call, and the KV bytes each
reads per step.

    PYTHONPATH=gen:. .venv/bin/python -m bench.mla_decode --heads 16 --num-threads 1

DeepSeek-V3's layer: hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64,
nope 128, v 128, bfloat16; random weights, made in memory. Every decode of a
step runs in one call over its own context (4k tokens by default), blocks
scattered over a latent pool filled with random values (the prefixes that
earlier steps wrote). The expanded form makes every head's K/V for every
context token: with all 128 heads that is 2.7 GB a step at 8 sequences (17 s
and 6.7 GB resident on one core of a 2-core Xeon); --heads cuts the query
heads (the latent the absorbed form reads does not depend on them). On a
machine whose cores are busy with other work, --num-threads 1: torch's
threads waiting on each other there cost more than the work.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DeepseekV3Config

from services.worker.attention import build_paged_step
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.mla import MlaAttention
from services.worker.rotary import Rotary
from services.worker.platforms import select_platform, torch_dtype

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def layer_config(args: argparse.Namespace) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=args.hidden, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora, kv_lora_rank=args.kv_lora, qk_rope_head_dim=args.rope,
        qk_nope_head_dim=args.nope, v_head_dim=args.v, num_hidden_layers=1, vocab_size=32,
        max_position_embeddings=163840, rope_parameters=dict(YARN),
    )


def random_weights(config: DeepseekV3Config, dtype: torch.dtype, device: torch.device,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    heads, qk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    shapes = {
        "q_a_proj.weight": (config.q_lora_rank, config.hidden_size),
        "q_a_layernorm.weight": (config.q_lora_rank,),
        "q_b_proj.weight": (heads * qk, config.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, config.hidden_size),
        "kv_a_layernorm.weight": (config.kv_lora_rank,),
        "kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
        "o_proj.weight": (config.hidden_size, heads * config.v_head_dim),
    }
    weights = {}
    for name, shape in shapes.items():
        # Norm weights near 1, the rest scaled so activations stay near unit size.
        values = torch.randn(shape, generator=generator)
        values = 1 + 0.1 * values if "layernorm" in name else values / shape[-1] ** 0.5
        weights["model.layers.0.self_attn." + name] = values.to(dtype=dtype, device=device)
    return weights


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=128, help="query heads (DeepSeek-V3: 128)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--q-lora", type=int, default=1536)
    parser.add_argument("--kv-lora", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--nope", type=int, default=128)
    parser.add_argument("--v", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096, help="tokens of each sequence, the new one included")
    parser.add_argument("--batches", default="1,8", help="decodes per step, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    platform = select_platform(args.device)
    dtype, device = torch_dtype(args.dtype), platform.device
    config = layer_config(args)
    generator = torch.Generator().manual_seed(0)
    weights = random_weights(config, dtype, device, generator)
    rotary = Rotary(config, config.qk_rope_head_dim)
    forms = {"absorbed": MlaAttention(config, weights, 0, platform, rotary, absorbed_decode=True),
             "expanded": MlaAttention(config, weights, 0, platform, rotary, absorbed_decode=False)}
    batches = [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-args.context // args.block_size)
    spec = KVCacheSpec.for_mla(config, args.block_size, dtype)
    pool = KVCachePool(spec, max(batches) * blocks_per_seq, device)
    for cache in pool.caches:  # the prefixes' latents, as earlier steps would have left them
        cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    scattered = torch.randperm(pool.num_blocks, generator=generator).tolist()
    element = torch.empty((), dtype=dtype).element_size()
    latent_values = args.kv_lora + args.rope
    per_head_values = args.heads * (args.nope + args.rope + args.v)

    steps = {}
    for batch in batches:
        tables = [scattered[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
        step = build_paged_step(pool, [1] * batch, [args.context - 1] * batch, tables, device)
        hidden = torch.randn(batch, args.hidden, generator=generator).to(dtype=dtype, device=device)
        steps[batch] = (step, hidden)
    times: dict[tuple[int, str], list[float]] = {(b, f): [] for b in batches for f in forms}
    outputs: dict[tuple[int, str], torch.Tensor] = {}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):
            for batch in batches:
                names = list(forms) if round_ % 2 == 0 else list(reversed(forms))
                for name in names:
                    step, hidden = steps[batch]
                    platform.synchronize()
                    start = time.perf_counter()
                    mla = forms[name]
                    outputs[batch, name] = mla.o_proj(mla(hidden, step))
                    platform.synchronize()
                    if round_ > 0:  # the first round warms up
                        times[batch, name].append((time.perf_counter() - start) * 1e3)

    print(f"MLA decode, one layer: {args.heads} heads, hidden {args.hidden}, latent {args.kv_lora} + {args.rope}, "
          f"{args.context}-token contexts, {args.dtype} on {device}, {torch.get_num_threads()} threads")
    print(f"{'seqs':>4}  {'form':<9} {'median ms':>10} {'p90 ms':>9}  {'latent read MB':>14}  "
          f"{'K/V per head made MB':>20}  {'max |diff|':>10}")
    for batch in batches:
        latent_mb = batch * args.context * latent_values * element / 1e6
        difference = float((outputs[batch, "absorbed"].float() - outputs[batch, "expanded"].float()).abs().max())
        for name in forms:
            values = times[batch, name]
            made_mb = batch * args.context * per_head_values * element / 1e6 if name == "expanded" else 0.0
            print(f"{batch:>4}  {name:<9} {statistics.median(values):>10.2f} {percentile(values, 0.9):>9.2f}  "
                  f"{latent_mb:>14.3g}  {made_mb:>20.3g}  {difference:>10.3g}", flush=True)


if __name__ == "__main__":
    main()
