"""Time the worker's model steps alone (no scheduler, no gRPC): a prefill of
one prompt and decode steps of a batch, on the bundled model, CPU.

    PYTHONPATH=gen:. python -m bench.step_time --prefill-len 256 --batch 8 --context 200

Prints one JSON object: per step kind the median and p90 in ms over `--reps`
runs after warm-up. bench/step_ab.py runs it against two source trees in
turn; it also runs on trees from before the platform objects (whose device
seam was services/worker/backend.py). `--tensor-parallel-size N` runs the
steps on a group of N ranks, this process rank 0 (parallel.py), each rank
on `--num-threads` threads.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from services.common.model_files import default_model_path, resolve_model
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput

try:
    from services.worker.platforms import select_platform
except ImportError:  # a tree from before the platform objects
    from services.worker.backend import select_backend as select_platform


def step_figures(samples: list[float]) -> dict:
    """Median and nearest-rank p90 of step times in seconds, as milliseconds."""
    ordered = sorted(samples)
    p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]  # nearest rank
    return {"median_ms": statistics.median(ordered) * 1e3, "p90_ms": p90 * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    parser.add_argument("--context", type=int, default=200, help="tokens each decoding sequence holds")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads of the worker, split between its ranks as the worker's setting; 0 = torch default")
    args = parser.parse_args()

    platform = select_platform("cpu")
    try:
        platform.set_num_threads(args.num_threads, args.tensor_parallel_size)
    except TypeError:  # a tree whose set_num_threads took the threads of this process only
        platform.set_num_threads(args.num_threads)
    if args.tensor_parallel_size > 1:
        from services.common.config import load_config
        from services.worker.config import WorkerConfig
        from services.worker.follower import build_runner
        from services.worker.parallel import TensorParallel

        config = load_config(WorkerConfig, environ={}, argv=[
            "--device", "cpu", "--dtype", args.dtype, "--cache-block-size", str(args.block_size),
            "--kv-cache-mib", "256", "--max-batch-size", str(args.batch + 1), "--num-threads", str(args.num_threads),
            "--tensor-parallel-size", str(args.tensor_parallel_size)])
        group = TensorParallel.start(config, platform)
        runner = build_runner(config, platform, group)
    else:
        group = None
        runner = ModelRunner(resolve_model(default_model_path()), platform, platform.resolve_dtype(args.dtype),
                             args.block_size, 256 * 2**20, max(args.batch, 1) + 1)
    runner.warm_up()
    greedy = SamplingParams(temperature=0.0)
    blocks_per_seq = -(-(max(args.context, args.prefill_len) + args.reps + 2) // args.block_size)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(args.batch + 1)]
    generator = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, runner.vocab_size, (n,), generator=generator).tolist()

    prefill = []
    for rep in range(args.reps + 1):
        seq_id = 10_000 + rep
        started = time.perf_counter()
        runner.step([SequenceInput(seq_id, prompt(args.prefill_len), 0, True, greedy, tables[-1])])
        if rep:  # the first is warm-up
            prefill.append(time.perf_counter() - started)
        runner.release(seq_id)

    # Fill every decoding sequence's context, then time one decode step of all at a time.
    first = runner.step([SequenceInput(i, prompt(args.context), 0, True, greedy, tables[i])
                         for i in range(args.batch)])
    last = {t.seq_id: t.token_id for t in first.tokens}
    decode = []
    for rep in range(args.reps + 1):
        inputs = [SequenceInput(i, [last[i]], args.context + rep, True, None, tables[i]) for i in range(args.batch)]
        started = time.perf_counter()
        result = runner.step(inputs)
        if rep:
            decode.append(time.perf_counter() - started)
        last = {t.seq_id: t.token_id for t in result.tokens}
    print(json.dumps({"dtype": runner.dtype_name, "prefill": step_figures(prefill), "decode": step_figures(decode)}), flush=True)
    if group is not None:
        group.close()


if __name__ == "__main__":
    main()
