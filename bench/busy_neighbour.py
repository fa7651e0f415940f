"""What a busy neighbour costs the chain: one 32-token answer at a time, with
the machine otherwise idle and with one other process spinning on a core (a
runaway template render, a sidecar, a noisy pod), for chains whose workers
differ only in how long their OpenMP threads spin before they sleep:
libgomp's own default (300,000), the worker's (10,000,
services/worker/__init__.py) and none (OMP_WAIT_POLICY=PASSIVE). The chains
run side by side and are measured in interleaved rounds; medians and p90s of
the answer's wall time, and each setting's ratios to libgomp's default.

    PYTHONPATH=gen:. .venv/bin/python -m bench.busy_neighbour --rounds 4
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from services.common.model_files import DEFAULT_MODEL_NAME
from services.common.supervisor import Chain, free_port

SETTINGS = {"libgomp default": {"GOMP_SPINCOUNT": "300000"},
            "worker default": {},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
SPIN = "while True: pass"


def answer_s(chain: Chain, max_tokens: int) -> float:
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0}).encode()
    request = urllib.request.Request(chain.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    urllib.request.urlopen(request, timeout=300).read()
    return time.perf_counter() - start


def figures(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[math.ceil(0.9 * len(ordered)) - 1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=3, help="answers per chain and load in a round")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="busy-neighbour-"))
    chains = {name: Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                          worker_ports=[free_port()], env={"STORMSERVE_KV_CACHE_MIB": "512", **env},
                          log_dir=work / f"logs-{i}", metrics=False)
              for i, (name, env) in enumerate(SETTINGS.items())}
    samples = {(name, load): [] for name in SETTINGS for load in ("idle", "busy")}
    try:
        for chain in chains.values():
            chain.start()
        for chain in chains.values():
            chain.wait_ready()
            answer_s(chain, 2)  # warm-up
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                for load in ("idle", "busy") if r % 2 == 0 else ("busy", "idle"):
                    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "busy" else None
                    try:
                        time.sleep(0.3 if spinner else 0)
                        samples[name, load] += [answer_s(chains[name], args.max_tokens)
                                                for _ in range(args.per_round)]
                    finally:
                        if spinner is not None:
                            spinner.kill()
                            spinner.wait()
            print(f"round {r} done", file=sys.stderr, flush=True)
    finally:
        for chain in chains.values():
            chain.stop()
    base = {load: figures(samples["libgomp default", load]) for load in ("idle", "busy")}
    result = {}
    for (name, load), values in samples.items():
        row = figures(values)
        row["median_ratio"] = row["median_s"] / base[load]["median_s"]
        row["p90_ratio"] = row["p90_s"] / base[load]["p90_s"]
        result[f"{name} / {load}"] = row
    print(json.dumps({"max_tokens": args.max_tokens, "rounds": args.rounds, "results": result}, indent=1))


if __name__ == "__main__":
    main()
