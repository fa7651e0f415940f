"""Interleaved bench.serve runs against several endpoints, and the medians.

Rounds alternate the order of the endpoints, and every run has prompts of its
own seed (two endpoints may share a server and its prefix cache), so neither
warm caches nor a drifting machine favours one of them:

    python -m bench.interleaved --target edge=http://127.0.0.1:8000 \
        --target envoy=http://127.0.0.1:8080 --levels 1:4,32:32 --rounds 6

Prints, per level and endpoint, the median over rounds of output tokens/s and
of the TTFT, ITL and end-to-end p50s, and the tokens/s range; with
`--metrics NAME=URL` (a stormserve scheduler's /metrics) also the draft
acceptance rate and generated tokens per engine step of that endpoint.

`--baseline NAME` pairs the runs: the endpoints of a round all get that
round's prompts (so they must be separate servers, with caches of their own),
and each endpoint's tokens/s is divided by the baseline's of the same round;
the table adds those ratios and their median. Where what a prompt asks moves
the speed (speculative decoding on copying prompts), only paired runs compare.
"""
from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--baseline", default="", help="a target's name: pair the runs of a round (same prompts) "
                                                       "and divide by its tokens/s")
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
            for i, name in enumerate(order):
                seed += not args.baseline or i == 0  # paired: one seed for the round's endpoints
                out = out_dir / f"{name}-{concurrency}-{rnd}.json"
                subprocess.run([sys.executable, "-m", "bench.serve", "--base-url", targets[name],
                                "--concurrency", str(concurrency), "--num-requests", str(requests),
                                "--input-len", args.input_len, "--output-len", args.output_len,
                                "--seed", str(seed), "--out", str(out), "--label", name,
                                "--workload", args.workload, "--metrics-url", metrics.get(name, "")],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results.setdefault((concurrency, name), []).append(json.loads(out.read_text())["levels"][0])
                print(f"round {rnd}: {name} at {concurrency}", file=sys.stderr, flush=True)
    paired = f" / {args.baseline} (per round) |" if args.baseline else ""
    print(f"| streams | endpoint | output tok/s | TTFT p50 | ITL p50 | e2e p50 | tok/s range | accepted | "
          f"tokens/step |{paired}  ({args.workload} prompts; runs in {out_dir})")
    for (concurrency, name), runs in sorted(results.items()):
        def p50(key: str) -> float:
            return 1000 * statistics.median(r[key]["p50"] for r in runs)

        def median_of(key: str) -> str:
            values = [r["speculation"][key] for r in runs if r.get("speculation")]
            return f"{statistics.median(values):.2f}" if values else "–"
        rates = sorted(r["output_tok_per_s"] for r in runs)
        print(f"| {concurrency} | {name} | {statistics.median(rates):.1f} | {p50('ttft_s'):.0f} ms | "
              f"{p50('itl_s'):.1f} ms | {p50('e2e_s'):.0f} ms | {rates[0]:.0f}–{rates[-1]:.0f} | "
              f"{median_of('acceptance_rate')} | {median_of('tokens_per_step')} |" + _ratios(runs, results, concurrency, args.baseline))


def chains_side_by_side(work: Path, envs: dict[str, dict[str, str]], baseline: str, levels: str, rounds: int,
                        input_len: str, output_len: str, peers: list[str] = ()) -> None:
    """One chain per entry of `envs` (name -> its STORMSERVE_* settings), all up at
    once, then this tool over them and `peers` (name=base_url), paired on
    `baseline`; the chains' logs and the runs under `work`."""
    from services.common.supervisor import Chain, free_port

    chains = {name: Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                          worker_ports=[free_port()], log_dir=work / f"logs-{name}", metrics=False, env=env)
              for name, env in envs.items()}
    try:
        for chain in chains.values():
            chain.start()
        for chain in chains.values():
            chain.wait_ready(timeout_s=900)
        targets = [f"--target={n}={c.url}" for n, c in chains.items()] + [f"--target={p}" for p in peers]
        subprocess.run([sys.executable, "-m", "bench.interleaved", *targets, "--levels", levels, "--rounds",
                        str(rounds), "--input-len", input_len, "--output-len", output_len, "--baseline", baseline,
                        "--out-dir", str(work / "runs")], check=True, env=os.environ)
    finally:
        for chain in chains.values():
            chain.stop()


def _ratios(runs: list[dict], results: dict[tuple[int, str], list[dict]], concurrency: int, baseline: str) -> str:
    """' **median** (round 0, round 1, ...) |': tokens/s over the baseline's in the same round."""
    if not baseline:
        return ""
    ratios = [r["output_tok_per_s"] / b["output_tok_per_s"] for r, b in zip(runs, results[(concurrency, baseline)])]
    return f" **{statistics.median(ratios):.2f}** ({', '.join(f'{x:.2f}' for x in ratios)}) |"


if __name__ == "__main__":
    main()
