"""The engine without the stack: the scheduler's batching policy driving the
worker's ModelRunner in one process — no HTTP, no gRPC, no detokenizing.

Same dataset, closed-loop levels and figures as bench.serve (it measures what
the whole chain could deliver at best), so the two tables compare directly:

    python -m bench.engine --concurrency 32 --num-requests 32 --input-len 200 --output-len 128

Steps are built with the scheduler's and the worker's own message converters,
as the chain builds them, without the wire in between.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench.serve import Progress, level_prompts, percentiles, print_table
from services.common.model_files import default_model_path, resolve_model
from services.scheduler.plan import WorkerCapacity
from services.scheduler.policy import BatchPolicy
from services.scheduler.sequence import SamplingParams, Sequence, StoppingCriteria
from services.scheduler.speculation import METHODS, SpeculationConfig, Speculator
from services.scheduler.worker_client import sampled_tokens, step_request
from services.worker.platforms import select_platform
from services.worker.convert import step_from_proto, step_to_proto
from services.worker.model_runner import ModelRunner


def _now_us() -> int:
    return time.perf_counter_ns() // 1000


def load_engine(model_path: str = "", dtype: str = "auto", block_size: int = 16, kv_cache_bytes: int = 0,
                max_batch_size: int = 64, max_seq_len: int = 2560):
    """(tokenizer, warmed-up CPU ModelRunner, the WorkerCapacity the scheduler sees) of a model
    (an HF directory or .gguf; empty = the bundled one)."""
    model_dir = resolve_model(model_path or default_model_path())
    platform = select_platform("cpu")
    runner = ModelRunner(model_dir, platform, platform.resolve_dtype(dtype), block_size, kv_cache_bytes,
                         max_batch_size, max_seq_len)
    runner.warm_up()
    info = runner.describe()
    capacity = WorkerCapacity(info.num_kv_blocks, info.block_size, info.max_batch_size,
                              frozenset(info.eos_token_ids))
    return AutoTokenizer.from_pretrained(model_dir), runner, capacity


def chat_prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as the one user message of a chat, templated as the chain templates it."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for p in prompts]


def run_level(runner: ModelRunner, policy: BatchPolicy, prompts: list[list[int]], concurrency: int,
              output_len: int, ids: itertools.count, admitted: list[Sequence] | None = None) -> dict:
    """Closed loop: `concurrency` requests in flight, a new one as soon as one ends.
    `admitted`, when given, gets every sequence as it is admitted."""
    greedy = SamplingParams(temperature=0.0)
    stopping = StoppingCriteria(max_tokens=output_len, ignore_eos=True)
    progress = Progress(len(prompts), f"concurrency {concurrency}")
    pending = list(prompts)
    first_token_us: dict[int, int] = {}
    last_token_us: dict[int, int] = {}
    arrival_us: dict[int, int] = {}
    ttft, itl, e2e, tokens = [], [], [], 0
    finished: set[int] = set()

    def admit() -> None:
        seq = Sequence(next(ids), "bench", pending.pop(0), greedy, stopping, _now_us())
        if admitted is not None:
            admitted.append(seq)
        arrival_us[seq.seq_id] = seq.arrival_us
        policy.add_group([seq])

    started = _now_us()
    for _ in range(min(concurrency, len(pending))):
        admit()
    while (plan := policy.schedule()) is not None:
        request = step_request(plan)
        step_started = _now_us()
        sampled = sampled_tokens(step_to_proto(request.step_id, runner.step(*step_from_proto(request))))
        now = _now_us()
        for seq, _ in policy.postprocess(plan, sampled, step_started, now):
            tokens += 1
            if seq.seq_id not in first_token_us:
                first_token_us[seq.seq_id] = now
                ttft.append((now - arrival_us[seq.seq_id]) / 1e6)
            else:
                itl.append((now - last_token_us[seq.seq_id]) / 1e6)
            last_token_us[seq.seq_id] = now
            # A step may deliver several tokens of a sequence (speculative decoding):
            # it finishes once, at its last.
            if seq.is_finished and seq.seq_id not in finished:
                finished.add(seq.seq_id)
                e2e.append((now - arrival_us[seq.seq_id]) / 1e6)
                progress.tick()
                if pending:
                    admit()
    elapsed = (_now_us() - started) / 1e6
    return {
        "level": f"concurrency {concurrency}", "concurrency": concurrency, "rate": None,
        "requests": len(prompts), "errors": [], "num_errors": 0, "duration_s": elapsed,
        "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="", help="HF directory or .gguf; empty = the bundled model")
    parser.add_argument("--dtype", default="auto", help="as the worker's dtype setting")
    parser.add_argument("--kv-cache-mib", type=int, default=0, help="as the worker's; 0 = automatic")
    parser.add_argument("--max-seq-len", type=int, default=2560, help="as maxSeqLen (sizes the automatic budget)")
    parser.add_argument("--cache-block-size", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=1024, help="as the scheduler's maxPrefillTokens")
    parser.add_argument("--concurrency", default="32", help="comma list of closed-loop levels")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per level")
    parser.add_argument("--input-len", type=int, default=200, help="approximate prompt tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/engine.json")
    parser.add_argument("--label", default="engine in-process")
    parser.add_argument("--workload", choices=("random", "grounded"), default="random")
    parser.add_argument("--speculative-method", choices=METHODS, default="off")
    parser.add_argument("--speculative-max-draft-tokens", type=int, default=8)
    args = parser.parse_args()
    speculation = SpeculationConfig(args.speculative_method, args.speculative_max_draft_tokens)

    tokenizer, runner, capacity = load_engine(args.model_path, args.dtype, args.cache_block_size,
                                              args.kv_cache_mib * 2**20, args.max_batch_size, args.max_seq_len)
    ids = itertools.count(1)
    levels = []
    for index, c in enumerate(filter(None, args.concurrency.split(","))):
        # The chat-templated prompts and warm-up request bench.serve sends at this level.
        warm_up, prompts = level_prompts(args.num_requests, args.input_len, args.seed, index, args.workload)
        warm_up, *prompts = chat_prompt_ids(tokenizer, [warm_up, *prompts])
        policy = BatchPolicy(capacity, args.max_batch_size, args.max_prefill_tokens, Speculator(speculation))
        run_level(runner, policy, [warm_up], 1, args.output_len, ids)
        levels.append(run_level(runner, policy, prompts, int(c), args.output_len, ids))
    print_table(levels)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "levels": levels}, indent=2))
    print(f"results: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
