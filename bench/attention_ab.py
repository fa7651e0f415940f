"""The CPU paged-attention kernel alone, A/B: builds the kernels of each source
directory given (this tree's services/worker/kernels, another worktree's) and
times, interleaved, the attention of one sequence with R new rows (a decode
and its draft) over a context, every layer of the bundled model's shape (9
query heads, 3 KV heads, head size 64, 30 layers), bfloat16, its blocks
scattered over the pool:

    PYTHONPATH=gen:. python -m bench.attention_ab --rows 1,5,9 \\
        services/worker/kernels /tmp/old/services/worker/kernels

Prints per row count the median ms per step of each directory, and the
largest difference of each output from the first's.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.worker import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16


def kernel(sources: Path) -> cpu_kernels.PagedAttention:
    """The bfloat16 paged-attention entry point built from `sources`."""
    library = cpu_kernels.load_library(sources)
    if library is None:
        raise SystemExit(f"could not build the kernels in {sources} (see the warning above)")
    return cpu_kernels.PagedAttention(library.paged_attention_bf16)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="kernel source directories")
    parser.add_argument("--rows", default="1,2,3,4,5,9,12", help="new rows of the sequence, comma-separated")
    parser.add_argument("--context", type=int, default=560, help="keys before the new rows")
    parser.add_argument("--reps", type=int, default=80)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    kernels = [kernel(path.resolve()) for path in args.sources]
    generator = torch.Generator().manual_seed(0)
    num_blocks = (args.context + 64) // BLOCK_SIZE * 4
    keys = [torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).bfloat16()
            for _ in range(LAYERS)]
    values = [torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).bfloat16()
              for _ in range(LAYERS)]
    table = torch.randperm(num_blocks, generator=generator)[: num_blocks // 4].reshape(1, -1)
    for rows in map(int, args.rows.split(",")):
        query = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).bfloat16()
        step = (table, torch.tensor([0]), torch.tensor([rows]), torch.tensor([args.context + rows]))

        def attend(run, layer):
            return run(query, keys[layer], values[layer], *step, BLOCK_SIZE, HEAD_DIM**-0.5, None)

        outputs = [attend(run, 0) for run in kernels]
        samples: list[list[float]] = [[] for _ in kernels]
        for _ in range(args.reps):
            for run, times in zip(kernels, samples):
                start = time.perf_counter()
                for layer in range(LAYERS):
                    attend(run, layer)
                times.append(time.perf_counter() - start)
        medians = " ".join(f"{statistics.median(times[args.reps // 8:]) * 1e3:.2f}" for times in samples)
        gaps = " ".join(f"{float((out.float() - outputs[0].float()).abs().max()):.2g}" for out in outputs)
        print(f"{rows} rows: {medians} ms per step; largest difference from the first: {gaps}", flush=True)


if __name__ == "__main__":
    main()
