"""Speculative decoding on against off, through the whole chain: starts one chain
per setting side by side (free ports, the bundled model, default dtype), then
runs bench.interleaved over both for each workload, so the rounds alternate
and both chains get the same prompts in a round (each round its own seed):

    PYTHONPATH=gen:. .venv/bin/python -m bench.speculative --method prompt_lookup \\
        --runs grounded:1:4,random:1:4,random:32:32,grounded:32:32 --rounds 3

Each `workload:streams:requests` prints a table with the medians of output
tokens/s, latencies, the draft acceptance rate and generated tokens per step,
and each endpoint's tokens/s over the `off` chain's, round by round.
`--peer name=url` adds another server to every round (docs: performance has
llama-server with and without its lookup decoding).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from services.common.supervisor import Chain, free_port


def start_chain(name: str, env: dict[str, str], log_dir: Path) -> Chain:
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  worker_ports=[free_port()], env={"STORMSERVE_KV_CACHE_MIB": "1024", **env},
                  log_dir=log_dir / name)
    chain.start()
    chain.wait_ready(timeout_s=600)
    return chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="prompt_lookup", help="STORMSERVE_SPECULATIVE_METHOD of the 'on' chain")
    parser.add_argument("--max-draft-tokens", default="8")
    parser.add_argument("--runs", default="grounded:1:4,random:1:4,random:32:32,grounded:32:32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", default="300")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--peer", action="append", default=[],
                        help="name=base_url of another OpenAI-compatible server to interleave with the two chains "
                             "(a llama-server with and without its lookup decoding, say)")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    settings = {
        "on": {"STORMSERVE_SPECULATIVE_METHOD": args.method,
               "STORMSERVE_SPECULATIVE_MAX_DRAFT_TOKENS": args.max_draft_tokens},
        "off": {"STORMSERVE_SPECULATIVE_METHOD": "off"},
    }
    with ExitStack() as stack:
        chains = {}
        for name, env in settings.items():
            chains[name] = start_chain(name, env, log_dir)
            stack.callback(chains[name].stop)
        print(f"chains ready (logs in {log_dir})", file=sys.stderr, flush=True)
        for run in args.runs.split(","):
            workload, streams, requests = run.split(":")
            command = [sys.executable, "-m", "bench.interleaved", "--workload", workload, "--baseline", "off",
                       "--levels", f"{streams}:{requests}", "--rounds", str(args.rounds),
                       "--input-len", args.input_len, "--output-len", args.output_len]
            for name, chain in chains.items():
                command += ["--target", f"{name}={chain.url}", "--metrics", f"{name}={chain.metrics_urls['scheduler']}"]
            for peer in args.peer:
                command += ["--target", peer]
            subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
