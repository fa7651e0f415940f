"""Interleaved bench.serve runs against several endpoints, and the medians.

Rounds alternate the order of the endpoints, and every run has prompts of its
own seed, so neither warm caches nor a drifting machine favours one of them:

    python -m bench.interleaved --target edge=http://127.0.0.1:8000 \
        --target envoy=http://127.0.0.1:8080 --levels 1:4,32:32 --rounds 6

Prints, per level and endpoint, the median over rounds of output tokens/s and
of the TTFT, ITL and end-to-end p50s, and the tokens/s range; with
`--metrics NAME=URL` (a stormserve scheduler's /metrics) also the draft
acceptance rate and generated tokens per engine step of that endpoint.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="name=base_url; give two or more")
    parser.add_argument("--levels", default="1:4,32:32", help="concurrency:requests, comma separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--input-len", default="200")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--seed", type=int, default=1000, help="first run's seed; each run takes the next")
    parser.add_argument("--workload", choices=("random", "grounded"), default="random")
    parser.add_argument("--metrics", action="append", default=[], help="name=scheduler metrics URL")
    parser.add_argument("--out-dir", default="")
    args = parser.parse_args()
    targets = dict(t.split("=", 1) for t in args.target)
    metrics = dict(m.split("=", 1) for m in args.metrics)
    levels = [tuple(int(x) for x in level.split(":")) for level in args.levels.split(",")]
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-interleaved-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[int, str], list[dict]] = {}
    seed = args.seed
    for rnd in range(args.rounds):
        order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
        for concurrency, requests in levels:
            for name in order:
                seed += 1
                out = out_dir / f"{name}-{concurrency}-{rnd}.json"
                subprocess.run([sys.executable, "-m", "bench.serve", "--base-url", targets[name],
                                "--concurrency", str(concurrency), "--num-requests", str(requests),
                                "--input-len", args.input_len, "--output-len", args.output_len,
                                "--seed", str(seed), "--out", str(out), "--label", name,
                                "--workload", args.workload, "--metrics-url", metrics.get(name, "")],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results.setdefault((concurrency, name), []).append(json.loads(out.read_text())["levels"][0])
                print(f"round {rnd}: {name} at {concurrency}", file=sys.stderr, flush=True)
    print(f"| streams | endpoint | output tok/s | TTFT p50 | ITL p50 | e2e p50 | tok/s range | accepted | "
          f"tokens/step |  ({args.workload} prompts; runs in {out_dir})")
    for (concurrency, name), runs in sorted(results.items()):
        def p50(key: str) -> float:
            return 1000 * statistics.median(r[key]["p50"] for r in runs)

        def median_of(key: str) -> str:
            values = [r["speculation"][key] for r in runs if r.get("speculation")]
            return f"{statistics.median(values):.2f}" if values else "–"
        rates = sorted(r["output_tok_per_s"] for r in runs)
        print(f"| {concurrency} | {name} | {statistics.median(rates):.1f} | {p50('ttft_s'):.0f} ms | "
              f"{p50('itl_s'):.1f} ms | {p50('e2e_s'):.0f} ms | {rates[0]:.0f}–{rates[-1]:.0f} | "
              f"{median_of('acceptance_rate')} | {median_of('tokens_per_step')} |")


if __name__ == "__main__":
    main()
