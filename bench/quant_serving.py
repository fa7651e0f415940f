"""The bundled model served three ways through `make run`'s chain, side by side:
its 4-bit weights with bfloat16 activations (`bfloat16`), with int8
activations on integer dot products (`int8`, STORMSERVE_ACTIVATIONS=int8), and
written as msModelSlim W8A8_DYNAMIC by the quantize command (`w8a8`), with any
peers (`--peer llama-server=http://127.0.0.1:8702`); `bench.interleaved` at 1
and 32 streams, interleaved rounds, medians and the ratios to `bfloat16`.

    PYTHONPATH=gen:. .venv/bin/python -m bench.quant_serving --rounds 4

bench/quant_quality.py measures what the variants cost in perplexity."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.interleaved import chains_side_by_side

VARIANTS = ("bfloat16", "int8", "w8a8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--peer", action="append", default=[], help="name=base_url of another server")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--levels", default="1:8,32:64", help="concurrency:requests, comma separated")
    parser.add_argument("--input-len", default="200")
    parser.add_argument("--output-len", default="64")
    parser.add_argument("--kv-cache-mib", default="512", help="each chain's KV pool (they run at once)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="quant-serving-"))
    env = {"STORMSERVE_KV_CACHE_MIB": args.kv_cache_mib}
    settings = {"bfloat16": {"STORMSERVE_ACTIVATIONS": "bfloat16"}, "int8": {"STORMSERVE_ACTIVATIONS": "int8"},
                "w8a8": {"STORMSERVE_MODEL_PATH": str(work / "w8a8")}}
    if "w8a8" in args.variants:
        subprocess.run([sys.executable, "-m", "services.worker.quantize", "default", str(work / "w8a8"),
                        "--format", "w8a8_dynamic"], check=True, env=os.environ)
    envs = {name: {**env, **settings[name]} for name in args.variants}
    chains_side_by_side(work, envs, args.variants[0], args.levels, args.rounds, args.input_len, args.output_len,
                        args.peer)
    print(f"models and logs in {work}")


if __name__ == "__main__":
    main()
