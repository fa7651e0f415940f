"""bench.step_time against two or more source trees, interleaved: one fresh
process per tree per round, trees alternating (the order flips every round),
so load from others on a shared machine falls on both sides alike. Prints
per tree the median over rounds of each step kind's median and p90, and the
median over rounds of its ratio to the first tree in the same round (the
pair ran back to back: the ratio is what interleaving makes meaningful). A tree may carry step_time flags of its own after
its path (the same tree twice compares settings):

    .venv/bin/python -m bench.step_ab --tree before=/path/to/main --tree after=. --rounds 6
    .venv/bin/python -m bench.step_ab --tree "tp1=. --num-threads 2" \
        --tree "tp2=. --tensor-parallel-size 2 --num-threads 1"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

STEP_TIME = Path(__file__).with_name("step_time.py")


def run(tree: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'gen'}{os.pathsep}{tree}"}
    # step_time.py from this tree, the worker from `tree`: its directory is not on sys.path.
    code = f"import runpy, sys; sys.argv = ['step_time', *{extra!r}]; runpy.run_path({str(STEP_TIME)!r}, run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"step_time failed in {tree}:\n{out.stderr[-3000:]}")
    # The figures' line; a tensor-parallel run's other ranks may log after it.
    return json.loads([line for line in out.stdout.splitlines() if line.startswith('{"dtype"')][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True,
                        help="name=path [step_time flags], two or more")
    parser.add_argument("--rounds", type=int, default=6)
    args, extra = parser.parse_known_args()
    trees = {name: shlex.split(spec) for name, spec in (t.split("=", 1) for t in args.tree)}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in order:
            path, *own = trees[name]
            results[name].append(run(Path(path).resolve(), [*extra, *own]))
            print(f"round {round_index + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    first = next(iter(trees))
    summary = {}
    for name, rounds in results.items():
        summary[name] = {kind: {stat: statistics.median(r[kind][stat] for r in rounds)
                                for stat in ("median_ms", "p90_ms")} for kind in ("prefill", "decode")}
    for name, figures in summary.items():
        ratios = {kind: statistics.median(r[kind]["median_ms"] / f[kind]["median_ms"]
                                          for r, f in zip(results[name], results[first])) for kind in figures}
        print(f"{name}: " + ", ".join(
            f"{kind} median {f['median_ms']:.2f} ms p90 {f['p90_ms']:.2f} ms (x{ratios[kind]:.3f} of {first})"
            for kind, f in figures.items()))


if __name__ == "__main__":
    main()
