"""One mixture-of-experts layer of Qwen3-30B-A3B's shape (hidden 2048, 128
experts, top-8, expert intermediate 768: about 1.2 GB in bfloat16, random
weights built in memory) on the CPU: the lean block (services/worker/moe.py
on the CPU platform) beside transformers' own Qwen3MoeSparseMoeBlock (eager
experts) on the same weights, in interleaved rounds, each round a fresh batch
of tokens (so its experts come from memory, not from the previous round's
cache), median and p90 ms:

    PYTHONPATH=gen:. python -m bench.moe_layer --tokens 1 32 256

Beside the times, two floors measured in the same rounds: the bandwidth floor
(bytes of the experts the batch touches, and the router, over this machine's
read bandwidth: a sum over a buffer much larger than the cache) and the
compute floor (the batch's FLOPs over the rate of our own dense linear kernel
on a matching matmul: the same rows through one expert's weights, warm in
cache), each the best of the rounds (the lowest floor), and ours over the
larger of the two.
"""
from __future__ import annotations

import argparse
import platform as host
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from services.worker import cpu_kernels
from services.worker.moe import MoE
from services.worker.platforms.cpu import CpuPlatform

PREFIX = "model.layers.0.mlp."


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def percentile_90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 host.processor())
    flags = [flag for flag in ("avx512_bf16", "amx_bf16", "avx2") if cpu_kernels.cpu_has(flag)]
    return f"{model}; flags {' '.join(flags) or 'none of avx512_bf16 amx_bf16 avx2'}; {torch.get_num_threads()} threads"


def build(args) -> tuple[Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, MoE]:
    config = Qwen3MoeConfig(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.intermediate, norm_topk_prob=True, num_hidden_layers=1,
                            experts_implementation="eager")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: no float32 copy of the experts
    try:
        block = Qwen3MoeSparseMoeBlock(config).eval()
    finally:
        torch.set_default_dtype(default)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():  # torch.empty until now
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.bfloat16) * 0.02)
    tensors = {PREFIX + "gate.weight": block.gate.weight.detach(),
               PREFIX + "experts.gate_up_proj": block.experts.gate_up_proj.detach(),
               PREFIX + "experts.down_proj": block.experts.down_proj.detach()}
    return config, block, MoE(config, tensors, PREFIX, CpuPlatform(torch.device("cpu")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="the buffer the read bandwidth is summed over")
    args = parser.parse_args(argv)
    hidden, intermediate, k = args.hidden, args.intermediate, args.top_k
    config, block, ours = build(args)
    expert_bytes = 3 * hidden * intermediate * 2  # gate, up and down, bfloat16
    router_bytes = args.experts * hidden * 2
    buffer = torch.ones(args.bandwidth_mib * 2**18, dtype=torch.float32)
    # One expert's weights as dense linears of our kernel: the compute floor's rate.
    platform = CpuPlatform(torch.device("cpu"))
    dense_gate_up = platform.linear(block.experts.gate_up_proj[0].detach(), None)
    dense_down = platform.linear(block.experts.down_proj[0].detach(), None)
    print(cpu_line())
    print(f"{'tokens':>6} {'experts':>7}  {'ours ms':>13}  {'transformers ms':>15}  {'GB/s':>5} {'GFLOP/s':>7}"
          f"  {'bw floor':>8} {'flop floor':>10}  {'ours/floor':>10}")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for count in args.tokens:
            rows = count * k
            dense_x, dense_mid = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, intermediate).bfloat16()
            flops = 2 * rows * 3 * hidden * intermediate + 2 * count * args.experts * hidden
            times: dict[str, list[float]] = {"ours": [], "transformers": []}
            bandwidths, rates, touched = [], [], []
            for round_ in range(args.rounds + 1):  # round 0 warms up
                h = torch.randn(count, hidden, generator=generator).bfloat16()
                ids = ours.platform.moe_select(ours.gate(h), ours.routing)[1]
                sides = {"ours": lambda: ours(h), "transformers": lambda: block(h[None])}
                order = list(sides) if round_ % 2 else list(reversed(sides))
                measured = {name: timed(sides[name]) for name in order}
                seconds = timed(lambda: buffer.sum()) / 1e3
                dense_down(dense_gate_up(dense_x)[:, :intermediate])  # the expert's weights into cache
                dense = timed(lambda: dense_gate_up(dense_x)) + timed(lambda: dense_down(dense_mid))
                if round_ == 0:
                    continue
                for name, value in measured.items():
                    times[name].append(value)
                bandwidths.append(buffer.numel() * 4 / seconds / 1e9)
                rates.append(2 * rows * 3 * hidden * intermediate / dense / 1e6)
                touched.append(ids.unique().numel())
            bandwidth, rate, experts = max(bandwidths), max(rates), statistics.median(touched)
            bandwidth_floor = (experts * expert_bytes + router_bytes) / bandwidth / 1e6
            compute_floor = flops / rate / 1e6
            ours_ms, theirs_ms = statistics.median(times["ours"]), statistics.median(times["transformers"])
            ratio = ours_ms / max(bandwidth_floor, compute_floor)
            print(f"{count:>6} {experts:>7.0f}  {ours_ms:6.2f} {percentile_90(times['ours']):6.2f}"
                  f"  {theirs_ms:7.2f} {percentile_90(times['transformers']):7.2f}  {bandwidth:5.3g} {rate:7.3g}"
                  f"  {bandwidth_floor:8.3g} {compute_floor:10.3g}  {ratio:10.2f}")


if __name__ == "__main__":
    main()
