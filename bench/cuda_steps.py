"""Time the worker's model steps alone on a device (no scheduler, no gRPC):
a prefill, decode steps of 1, 8 and 32 sequences, and drafted steps (each
sequence feeding its last token and 4 drafted ones), once per KV block size
(16 and 256; each line names the attention kernel that ran).

    PYTHONPATH=gen:. python -m bench.cuda_steps --device cuda --dtype bfloat16

bench/gpu_check.sh runs it on a GPU machine, once with STORMSERVE_GRAPHS=auto
and once with =off. The model is the one the GPU tests run
(tests/gpu/models.py: the bundled SmolLM2-135M where installed, else a
stand-in of its shape; timings depend on the shapes alone). The runner is
built as the worker builds it (its config from these flags and the
STORMSERVE_* environment, then follower.build_runner), so a worker setting
given in the environment applies here too: STORMSERVE_GRAPHS (auto: decode
steps replay graphs captured at start, where the platform and the attention
kernel allow; off: every step eager). Each line gives that setting and the
batch sizes whose graphs were captured (null: none, the log says why).

Each figure is the median and p90 of `--reps` steps after `--warm-up`
untimed ones, each step timed from a synchronized device to the step's
return (the runner synchronizes before it returns). Prints one JSON object
per block size; a block size whose steps fail prints the error instead.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from bench.step_time import step_figures
from services.common.config import load_config
from services.common.log import setup_logging
from services.worker.config import WorkerConfig
from services.worker.follower import build_runner
from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams, SequenceInput
from tests.gpu.models import check_model


class Steps:
    def __init__(self, runner: ModelRunner, args: argparse.Namespace, per_seq_blocks: int):
        self.runner, self.args, self.per_seq_blocks = runner, args, per_seq_blocks
        self.generator = torch.Generator().manual_seed(0)
        self.device = runner.backend.device

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.runner.vocab_size, (n,), generator=self.generator).tolist()

    def table(self, slot: int) -> list[int]:
        return list(range(slot * self.per_seq_blocks, (slot + 1) * self.per_seq_blocks))

    def timed(self, make_inputs, after) -> dict:
        samples = []
        for rep in range(self.args.warm_up + self.args.reps):
            inputs = make_inputs()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            result = self.runner.step(inputs)
            elapsed = time.perf_counter() - started
            if rep >= self.args.warm_up:
                samples.append(elapsed)
            after(result)
        return step_figures(samples)

    def prefill(self) -> dict:
        seq_ids = iter(range(10_000, 20_000))
        current: list[int] = []

        def make():
            current[:] = [next(seq_ids)]
            return [SequenceInput(current[0], self.tokens(self.args.prefill_len), 0, True,
                                  SamplingParams(temperature=0.0), self.table(0))]

        return self.timed(make, lambda result: self.runner.release(current[0]))

    def decode(self, batch: int, draft: int) -> dict:
        """Decode steps of `batch` sequences over `--context` tokens each, each
        feeding `draft` random (so rejected) drafted tokens after its last one."""
        greedy = SamplingParams(temperature=0.0)
        seq_ids = list(range(batch))
        first = self.runner.step([SequenceInput(i, self.tokens(self.args.context), 0, True, greedy,
                                                self.table(1 + i)) for i in seq_ids])
        last = {t.seq_id: t.token_id for t in first.tokens}
        computed = dict.fromkeys(seq_ids, self.args.context)

        def make():
            return [SequenceInput(i, [last[i], *self.tokens(draft)], computed[i], True, None, self.table(1 + i),
                                  num_draft_tokens=draft) for i in seq_ids]

        def after(result):
            for t in result.tokens:
                computed[t.seq_id] += 1 + t.num_accepted_draft_tokens
                last[t.seq_id] = t.token_id

        figures = self.timed(make, after)
        for i in seq_ids:
            self.runner.release(i)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-sizes", default="16,256")
    parser.add_argument("--batches", default="1,8,32", help="sequences per decode step")
    parser.add_argument("--draft-batches", default="1,8", help="sequences per drafted step")
    parser.add_argument("--draft", type=int, default=4, help="drafted tokens per sequence")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=200, help="tokens each decoding sequence holds")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=3)
    args = parser.parse_args()
    setup_logging("cuda_steps")  # the runner's own lines: graphs captured (or why not), load and warm-up times

    platform = select_platform(args.device)
    model_dir, model = check_model()
    batches = [int(b) for b in args.batches.split(",")]
    draft_batches = [int(b) for b in args.draft_batches.split(",") if b]
    header = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "model": model, "dtype": args.dtype}
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        # Each sequence's own blocks: its context, every timed step's tokens, and a draft.
        longest = max(args.context, args.prefill_len) + (args.warm_up + args.reps) * (1 + args.draft) + 1
        per_seq_blocks = -(-longest // block_size)
        num_seqs = 1 + max(batches + draft_batches)
        line: dict = {**header, "block_size": block_size}
        try:
            config = load_config(WorkerConfig, argv=[
                "--model-path", str(model_dir), "--device", args.device, "--dtype", args.dtype,
                "--cache-block-size", str(block_size), "--kv-cache-mib", "0", "--max-batch-size", str(num_seqs),
                "--max-seq-len", str(per_seq_blocks * block_size)])
            runner = build_runner(config, platform, None)
            # The batch sizes whose decode steps replay a graph; None: every step eager (the log says why).
            line["graphs"] = {"setting": config.graphs,
                              "replayed_batch_sizes": runner.graphs.sizes if runner.graphs is not None else None}
            line["attention"] = type(runner.attention_kernel).__name__ if runner.attention_kernel else "SDPA"
            steps = Steps(runner, args, per_seq_blocks)
            runner.warm_up()
            line[f"prefill_{args.prefill_len}"] = steps.prefill()
            for batch in batches:
                line[f"decode_{batch}x1"] = steps.decode(batch, 0)
            for batch in draft_batches:
                line[f"drafted_{batch}x{1 + args.draft}"] = steps.decode(batch, args.draft)
        except Exception as exc:  # noqa: BLE001 - a block size that fails is a finding, not the end
            line["error"] = f"{type(exc).__name__}: {exc}"
            line["where"] = traceback.format_exc().strip().splitlines()[-3:]
        print(json.dumps(line), flush=True)
        runner = steps = None
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
