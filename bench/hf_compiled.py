"""Hugging Face transformers' own fast decode, beside which bench.cuda_steps'
figures are read: `generate()` with a static KV cache and the decoding
forward compiled by torch.compile (mode "reduce-overhead": CUDA graphs), on
the same model (tests/gpu/models.py), dtype and GPU.

    PYTHONPATH=gen:. python -m bench.hf_compiled --device cuda --dtype bfloat16 --batches 1,32

bench/gpu_check.sh runs it after bench.cuda_steps. How it compiles: as
transformers documents it (docs: "Optimizing inference", static kv-cache and
torch.compile; CompileConfig), `generation_config.cache_implementation =
"static"` with a `compile_config` (reduce-overhead, fullgraph, static shapes).
Given a static cache on CUDA, generate() compiles the model's call for the
decoding steps itself and runs the prefill eagerly; replacing
`model.forward` by a compiled one as well, the docs' older recipe, would also
compile the prefill (one more compilation per batch and prompt length) and
nest one compiled call in the other. `--no-compile` runs the static cache
eagerly; on a CPU (a dry run) compilation is forced on with Inductor's CPU
code and no CUDA graphs.

What is timed: the per-token decode step, without the prefill. Each rep runs
generate() for N and for 2N new tokens (greedy, EOS off, so exactly that
many) on the same prompts and the same static cache size, in alternating
order, each timed from a synchronized device to a synchronized device; the
rep's step time is (t(2N) - t(N)) / N, in which the prefill, the cache set-up
and generate()'s per-call work cancel. A step is one token of every
sequence of the batch, as a decode step of bench.cuda_steps is, and includes
what generate() does around the forward (greedy choice, stopping checks).
Every batch is warmed twice at both lengths first (the first call compiles);
`compiled_graphs` counts what Dynamo compiled then, `compiled_while_timed`
anything after (a recompilation there would spoil the figures), and
`cudagraph_skips` the compiled graphs that ran without CUDA graphs. Prints one
JSON line per batch size: median and p90 over `--reps` of the step, and of
each length's whole generate() call.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from bench.step_time import step_figures
from tests.gpu.models import check_model


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cudagraph_skips() -> int:
    """Compiled graphs Inductor ran without CUDA graphs (the log says why)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


class Generate:
    """generate() on one batch of random prompts, timed."""

    def __init__(self, model, batch: int, args: argparse.Namespace):
        generator = torch.Generator().manual_seed(batch)
        self.model, self.device = model, model.device
        self.input_ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=generator)
        self.input_ids = self.input_ids.to(self.device)
        self.attention_mask = torch.ones_like(self.input_ids)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, new_tokens: int) -> float:
        self.sync()
        started = time.perf_counter()
        out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask, do_sample=False,
                                  max_new_tokens=new_tokens)
        self.sync()
        elapsed = time.perf_counter() - started
        made = out.shape[1] - self.input_ids.shape[1]
        if made != new_tokens:
            raise RuntimeError(f"generate() made {made} tokens, not {new_tokens}")
        return elapsed


def measure(model, batch: int, args: argparse.Namespace) -> dict:
    run = Generate(model, batch, args)
    n, n2 = args.new_tokens, 2 * args.new_tokens
    graphs_before, skips_before = unique_graphs(), cudagraph_skips()
    first_calls = []
    for _ in range(2):  # every shape twice: the first compiles, the second settles the CUDA graphs
        first_calls += [round(run(n2), 3), round(run(n), 3)]
    compiled = unique_graphs() - graphs_before
    short, long, steps = [], [], []
    for rep in range(args.reps):
        if rep % 2:
            t2 = run(n2)
            t1 = run(n)
        else:
            t1 = run(n)
            t2 = run(n2)
        short.append(t1)
        long.append(t2)
        steps.append((t2 - t1) / n)
    step = step_figures(steps)
    return {"batch": batch, "warm_up_calls_s": first_calls, "compiled_graphs": compiled,
            "compiled_while_timed": unique_graphs() - graphs_before - compiled,
            "cudagraph_skips": cudagraph_skips() - skips_before,
            "decode_step": step, "tok_per_s": batch / step["median_ms"] * 1e3,
            f"generate_{n}": step_figures(short), f"generate_{n2}": step_figures(long)}


def load(model_dir, args: argparse.Namespace, fullgraph: bool):
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    config = model.generation_config
    config.cache_implementation = "static"
    # One static cache size for both lengths (older transformers: the largest cache so far is kept).
    config.max_cache_len = args.prompt_len + 2 * args.new_tokens
    config.eos_token_id = None  # exactly max_new_tokens, whatever the random weights pick
    config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if args.compile:
        config.compile_config = CompileConfig(fullgraph=fullgraph, mode="reduce-overhead", dynamic=False)
        if args.device != "cuda":
            config.compile_config._compile_all_devices = True  # a dry run: Inductor's CPU code
    else:
        config.disable_compile = True
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,32", help="sequences per step")
    parser.add_argument("--prompt-len", type=int, default=200, help="prompt tokens of each sequence")
    parser.add_argument("--new-tokens", type=int, default=64, help="N: generate() runs for N and 2N new tokens")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    import transformers

    model_dir, what = check_model()
    header = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "transformers": transformers.__version__, "model": what,
              "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": [args.new_tokens, 2 * args.new_tokens],
              "compile": "reduce-overhead, static shapes" if args.compile else "off (static cache, eager)"}
    fullgraph = True
    model = load(model_dir, args, fullgraph)
    for batch in (int(b) for b in args.batches.split(",")):
        line: dict = {**header, "fullgraph": fullgraph if args.compile else None}
        try:
            try:
                line.update(measure(model, batch, args))
            except Exception as exc:  # noqa: BLE001
                if not (args.compile and fullgraph):
                    raise
                # A graph break under fullgraph: say so, then compile it in pieces as generate()'s default does.
                line["fullgraph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                torch._dynamo.reset()
                fullgraph = line["fullgraph"] = False
                model = load(model_dir, args, fullgraph)
                line.update(measure(model, batch, args))
        except Exception as exc:  # noqa: BLE001 - a batch that fails is a finding, not the end
            line["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            line["where"] = traceback.format_exc().strip().splitlines()[-3:]
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
