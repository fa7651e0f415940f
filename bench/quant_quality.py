"""What quantization costs in quality, in-process on CPU: each variant's
perplexity on a fixed text (bench/data/quality.txt) and its greedy agreement
with bfloat16 on fixed prompts.

    PYTHONPATH=gen:. python -m bench.quant_quality
    PYTHONPATH=gen:. python -m bench.quant_quality --model ./my-model --variants bfloat16 w8a8_dynamic

Variants: `bfloat16` (the model as it is; the baseline), `int8-activations`
(the same with STORMSERVE_ACTIVATIONS=int8: 4-bit weights on int8 dot
products), `float32`, and `w8a8_dynamic` / `w8a8` (msModelSlim checkpoints
written by services.worker.quantize into a temporary directory, served in
bfloat16). The text is cut into segments scored with every row's logits (a
segment's tokens after its first are fed as a draft); the prompts are chat
messages, continued greedily for --new-tokens. Prints a table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from services.common.model_files import default_model_path, resolve_model
from services.worker.model_runner import ModelRunner
from services.worker.platforms.cpu import CpuPlatform
from services.worker.quantize import main as quantize_main
from services.worker.sequence import SamplingParams, SequenceInput

TEXT = Path(__file__).parent / "data" / "quality.txt"
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn rain.",
    "What is 17 times 23? Show your working.",
    "Give three tips for writing clear emails.",
    "Translate 'good morning, how are you?' into French.",
    "Write a Python function that reverses a string.",
    "Name the planets of the solar system in order.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
)
VARIANTS = ("bfloat16", "int8-activations", "w8a8_dynamic", "w8a8", "float32")
BLOCK = 16


class Tables:
    """Contiguous block tables for sequences of at most `length` tokens."""

    def __init__(self, length: int):
        self.per_sequence = -(-length // BLOCK)

    def __call__(self, index: int) -> list[int]:
        return list(range(index * self.per_sequence, (index + 1) * self.per_sequence))


def perplexity(runner: ModelRunner, ids: list[int], segment: int) -> float:
    """exp of the mean negative log-likelihood of every token after the first of each segment."""
    segments = [ids[i:i + segment] for i in range(0, len(ids) - 1, segment) if len(ids[i:i + segment]) > 2]
    tables = Tables(segment + 1)
    greedy = SamplingParams(temperature=0.0)
    first = runner.forward([SequenceInput(i, s[:1], 0, True, greedy, tables(i)) for i, s in enumerate(segments)])
    rest = runner.forward([SequenceInput(i, s[1:], 1, True, None, tables(i), num_draft_tokens=len(s) - 2)
                           for i, s in enumerate(segments)])
    nll, count, row = 0.0, 0, 0
    for i, s in enumerate(segments):
        logits = torch.cat([first[i:i + 1], rest[row:row + len(s) - 2]]).float()  # predicting s[1:]
        row += len(s) - 1
        nll += float(F.cross_entropy(logits, torch.tensor(s[1:]), reduction="sum"))
        count += len(s) - 1
        runner.release(i)
    return math.exp(nll / count)


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    tables = Tables(max(map(len, prompts)) + new_tokens + 1)
    greedy = SamplingParams(temperature=0.0)
    result = runner.step([SequenceInput(i, p, 0, True, greedy, tables(i)) for i, p in enumerate(prompts)])
    out = [[t.token_id] for t in sorted(result.tokens, key=lambda t: t.seq_id)]
    for _ in range(new_tokens - 1):
        result = runner.step([SequenceInput(i, [out[i][-1]], len(p) + len(out[i]) - 1, True, None, tables(i))
                              for i, p in enumerate(prompts)])
        for t in result.tokens:
            out[t.seq_id].append(t.token_id)
    for i in range(len(prompts)):
        runner.release(i)
    return out


def agreement(tokens: list[list[int]], baseline: list[list[int]]) -> tuple[float, float]:
    """(share of prompts continued identically, mean share of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for ours, theirs in zip(tokens, baseline):
        same += ours == theirs
        common = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        prefix += common / len(theirs)
    return same / len(baseline), prefix / len(baseline)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="an HF directory, a .gguf file, or default")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS[:4]), choices=VARIANTS)
    parser.add_argument("--segment", type=int, default=128, help="tokens a perplexity segment holds")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--text-tokens", type=int, default=0, help="score only the text's first N tokens (0: all)")
    args = parser.parse_args(argv)

    model_dir = resolve_model(default_model_path() if args.model == "default" else args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(TEXT.read_text())["input_ids"]
    ids = ids[:args.text_tokens] if args.text_tokens else ids
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    results: dict[str, dict] = {}
    baseline: list[list[int]] | None = None
    with tempfile.TemporaryDirectory() as scratch:
        for variant in ["bfloat16", *[v for v in args.variants if v != "bfloat16"]]:
            directory, dtype, activations = model_dir, "bfloat16", "bfloat16"
            if variant == "float32":
                dtype = "float32"
            elif variant == "int8-activations":
                activations = "int8"
            elif variant in ("w8a8_dynamic", "w8a8"):
                directory = Path(scratch) / variant
                if quantize_main([str(model_dir), str(directory), "--format", variant]) != 0:
                    raise SystemExit(f"quantizing to {variant} failed")
            platform = CpuPlatform(torch.device("cpu"))
            platform.set_activations(activations)
            runner = ModelRunner(directory, platform, dtype, BLOCK, 512 * 2**20, len(PROMPTS) + 16)
            with torch.inference_mode():
                ppl = perplexity(runner, ids, args.segment)
                tokens = greedy_tokens(runner, prompts, args.new_tokens)
            baseline = baseline or tokens
            same, prefix = agreement(tokens, baseline)
            results[variant] = {"perplexity": ppl, "identical": same, "common_prefix": prefix}
            del runner
    base = results["bfloat16"]["perplexity"]
    print(f"{model_dir.name}: {len(ids)} tokens in segments of {args.segment}, {len(PROMPTS)} prompts × "
          f"{args.new_tokens} greedy tokens")
    print(f"{'variant':<18}{'perplexity':>11}{'vs bf16':>9}{'identical':>11}{'common prefix':>15}")
    for variant, r in results.items():
        print(f"{variant:<18}{r['perplexity']:>11.3f}{r['perplexity'] / base - 1:>+9.2%}"
              f"{r['identical']:>11.0%}{r['common_prefix']:>15.0%}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
