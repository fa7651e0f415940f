"""What metrics cost: two chains side by side, one with every /metrics port on
(and scraped every `--scrape-s` seconds, as a Prometheus would), one with
them off; `bench.serve` at one closed-loop level against each, in interleaved
rounds (on/off, then off/on, ...); medians of output tokens/s.

    PYTHONPATH=gen:. .venv/bin/python -m bench.metrics_cost --rounds 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

from services.common.supervisor import Chain, free_port


def scrape_until(chain: Chain, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        for url in chain.metrics_urls.values():
            urllib.request.urlopen(url, timeout=5).read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--scrape-s", type=float, default=5.0)
    parser.add_argument("--kv-cache-mib", default="1024", help="each chain's KV pool (two run at once)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="metrics-cost-"))
    chains = {
        mode: Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                    worker_ports=[free_port()], env={"STORMSERVE_KV_CACHE_MIB": args.kv_cache_mib},
                    log_dir=work / f"logs-{mode}", metrics=mode == "on")
        for mode in ("on", "off")
    }
    results: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for chain in chains.values():
            chain.start()
        for chain in chains.values():
            chain.wait_ready()
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                chain, stop = chains[mode], threading.Event()
                scraper = threading.Thread(target=scrape_until, args=(chain, stop, args.scrape_s), daemon=True)
                if mode == "on":
                    scraper.start()
                out = work / f"{mode}-{r}.json"
                subprocess.run(
                    [sys.executable, "-m", "bench.serve", "--base-url", chain.url,
                     "--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests),
                     "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                     "--out", str(out), "--label", mode],
                    check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
                stop.set()
                tok_s = json.loads(out.read_text())["levels"][0]["output_tok_per_s"]
                results[mode].append(tok_s)
                print(f"round {r} metrics {mode}: {tok_s:.1f} tok/s", flush=True)
    finally:
        for chain in chains.values():
            chain.stop()
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"median on {on:.1f}, off {off:.1f} tok/s: metrics cost {100 * (off - on) / off:+.2f} % (logs in {work})")


if __name__ == "__main__":
    main()
