"""The CPU linear kernels side by side on the bundled model's shapes (SmolLM2-135M:
per layer qkv 576 -> 960, o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576;
30 layers and lm_head 576 -> 49152): linear.c's bfloat16 and 4-bit kernels
beside int8.c's W4A8 and W8A8, each on its own random weights for every layer
(so a pass reads them from memory: the four formats together are several times
the cache), one pass of a step's linears per timing, bfloat16 rows in and out,
interleaved over rounds (the order alternates):

    PYTHONPATH=gen:. python -m bench.int8_linear --rows 1 4 8 32

Each build of the kernels runs: `native` (-march=native), and with
`--variants`, `avx_vnni` (-mno-avx512f) and `avx2` (-mno-avx512f
-mno-avxvnni), the builds of CPUs without AVX-512 (or VNNI) measured on this
one. Prints per build and row count the median and p90 ms per pass of each
kernel, and the medians of the per-round ratios of W4A8 and W8A8 to bfloat16
and to the 4-bit kernel (below 1: faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.worker import cpu_kernels, int8_kernels

VARIANTS = {"native": (), "avx_vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni")}
KERNELS = ("bf16", "q4", "w4a8", "w8a8")


def percentile_90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 "unknown CPU")
    flags = [flag for flag in ("avx512_vnni", "avx512_bf16", "avx_vnni", "avx2", "amx_int8")
             if cpu_kernels.cpu_has(flag)]
    return f"{model}; flags {' '.join(flags) or 'none of avx512_vnni avx512_bf16 avx_vnni avx2'}; " \
           f"{torch.get_num_threads()} threads"


def shapes(args) -> list[tuple[int, int]]:
    """(out, in) of every linear of a step, in the order a step runs them."""
    layer = [(args.qkv, args.hidden), (args.hidden, args.hidden), (2 * args.intermediate, args.hidden),
             (args.hidden, args.intermediate)]
    return layer * args.layers + [(args.vocab, args.hidden)]


def build(library, linears: list[tuple[int, int]], generator: torch.Generator) -> dict[str, list]:
    """Per kernel the step's linears on `library`, each on weights of its own
    (missing: a kernel this build lacks)."""
    built: dict[str, list] = {name: [] for name in KERNELS}
    for out_features, in_features in linears:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).bfloat16()
        built["bf16"].append(cpu_kernels.packed_linear(weight, None, library=library))
        del weight
        groups = (out_features, in_features // 32)
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
        scale = torch.rand(groups, generator=generator) * 0.002 + 1e-4
        low = -7.5 * scale
        built["q4"].append(cpu_kernels.packed_q4_linear(codes, scale, low, None, library=library))
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
        built["w4a8"].append(int8_kernels.packed_q4a8_linear(codes, scale, low, None, library=library))
        del codes
        weight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        built["w8a8"].append(int8_kernels.packed_int8_linear(weight, torch.rand(out_features) * 1e-3, None,
                                                            library=library))
    return {name: linears for name, linears in built.items() if all(linear is not None for linear in linears)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["native", "avx2"])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--qkv", type=int, default=960)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0: as set")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    linears = shapes(args)
    generator = torch.Generator().manual_seed(0)
    print(cpu_line())
    kernels: dict[tuple[str, str], list] = {}
    isas: dict[str, str] = {}
    for variant in args.variants:
        library = cpu_kernels.load_library(cpu_kernels._KERNELS, VARIANTS[variant])
        isa = None if library is None else int8_kernels.int8_linear_isa(library)
        if isa is None or (variant != "native" and not cpu_kernels.cpu_has(variant)):
            print(f"{variant}: not built for this CPU, skipped")
            continue
        isas[variant] = isa
        for name, step in build(library, linears, generator).items():
            kernels[variant, name] = step
    print(f"{'build':>8} {'int8 on':>11} {'rows':>4}  " + "  ".join(f"{name + ' ms':>13}" for name in KERNELS)
          + f"  {'w4a8/bf16':>9} {'w4a8/q4':>7} {'w8a8/bf16':>9} {'w8a8/q4':>7}")
    with torch.no_grad():
        for rows in args.rows:
            x = {in_features: torch.randn(rows, in_features, generator=generator).bfloat16()
                 for _, in_features in linears}
            times: dict[tuple[str, str], list[float]] = {key: [] for key in kernels}
            for round_ in range(args.rounds + 1):  # round 0 warms up
                order = list(kernels) if round_ % 2 else list(reversed(kernels))
                for key in order:
                    start = time.perf_counter()
                    for linear, (_, in_features) in zip(kernels[key], linears):
                        linear(x[in_features])
                    if round_:
                        times[key].append((time.perf_counter() - start) * 1e3)
            for variant, isa in isas.items():
                cells, ratios = [], []
                for name in KERNELS:
                    values = times.get((variant, name))
                    cells.append(f"{statistics.median(values):6.2f} {percentile_90(values):6.2f}" if values
                                 else f"{'-':>13}")
                for ours, theirs in (("w4a8", "bf16"), ("w4a8", "q4"), ("w8a8", "bf16"), ("w8a8", "q4")):
                    a, b = times.get((variant, ours)), times.get((variant, theirs))
                    ratios.append(f"{statistics.median(p / q for p, q in zip(a, b)):.2f}" if a and b else "-")
                print(f"{variant:>8} {isa:>11} {rows:>4}  " + "  ".join(cells)
                      + f"  {ratios[0]:>9} {ratios[1]:>7} {ratios[2]:>9} {ratios[3]:>7}")


if __name__ == "__main__":
    main()
