"""Drafting rules replayed on recorded greedy answers, without the model: how
many steps a 1-stream sequence would take under the scheduler's Speculator.

Greedy answers do not depend on speculation, so they are recorded once (the
model in-process, speculation off; `--record`), and the Speculator is then
driven over them as the scheduler drives one running sequence: it waits for a
step's answer when it has a draft in flight or `wants_draft`, proposes after
the wait, and learns from what the answer kept. Each step yields the kept
drafts and one token. Prints steps, tokens per step and the share of drafted
tokens kept; the time a step takes is left to bench.speculative. `--oracle`
adds the bound of drafting by copying: every step drafts the longest run of
the answer's next tokens that occurs anywhere before them.

    PYTHONPATH=gen:. python -m bench.draft_replay --record --workload grounded --num-prompts 24
    PYTHONPATH=gen:. python -m bench.draft_replay --workload grounded --max-draft-tokens 8
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from bench.serve import level_prompts
from services.scheduler.sequence import SamplingParams, Sequence, StoppingCriteria
from services.scheduler.speculation import METHODS, SpeculationConfig, Speculator


def record(workload: str, num_prompts: int, input_len: int, output_len: int, seed: int) -> list[dict]:
    """Prompt and greedy answer token ids, through the scheduler's policy and the worker's runner."""
    from bench.engine import chat_prompt_ids, load_engine, run_level
    from services.scheduler.policy import BatchPolicy

    tokenizer, runner, capacity = load_engine(kv_cache_bytes=512 * 2**20)
    _, prompts = level_prompts(num_prompts, input_len, seed, 0, workload)
    policy = BatchPolicy(capacity, 64, 1024, Speculator(SpeculationConfig("off")))
    admitted: list[Sequence] = []
    run_level(runner, policy, chat_prompt_ids(tokenizer, prompts), 4, output_len, itertools.count(1), admitted)
    return [{"prompt": seq.prompt_token_ids, "output": seq.output_token_ids} for seq in admitted]


def replay(answers: list[dict], config: SpeculationConfig, budget: int) -> dict:
    """Drive a Speculator over each answer in turn, as for a sequence running alone."""
    speculator = Speculator(config)
    steps = tokens = drafted = kept = 0
    for seq_id, answer in enumerate(answers, start=1):
        output = answer["output"]
        n = len(output)
        seq = Sequence(seq_id, "replay", list(answer["prompt"]), SamplingParams(temperature=0.0),
                       StoppingCriteria(max_tokens=n, ignore_eos=True), 0)
        waits = n > 1 and speculator.wants_draft(seq, 1)  # decided while the prefill runs
        seq.output_token_ids.append(output[0])
        while len(seq.output_token_ids) < n:
            i = len(seq.output_token_ids)
            speculator.draft_budget(1)
            draft = speculator.propose(seq, min(budget, n - i - 1)) if waits else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[i + accepted]:
                accepted += 1
            if draft:
                speculator.on_verified(seq, len(draft), accepted)
                drafted, kept = drafted + len(draft), kept + accepted
            steps += 1
            new = output[i:i + accepted + 1]
            # The next step is planned while this one runs: before its tokens are known.
            waits = i + len(new) < n and (bool(draft) or (i + 1 < n and speculator.wants_draft(seq, 1)))
            seq.output_token_ids.extend(new)
        speculator.on_finished(seq)
        tokens += n - 1
    return {"steps": steps, "tokens_per_step": round(tokens / max(1, steps), 2),
            "accepted": round(kept / max(1, drafted), 2)}


def oracle(answers: list[dict], max_len: int) -> dict:
    """The bound of drafting by copying: each step drafts the longest run (up to
    `max_len`) of the answer's next tokens found anywhere in the tokens before it."""
    steps = tokens = 0
    for answer in answers:
        output = answer["output"]
        i = 1
        while i < len(output):
            seen, run = answer["prompt"] + output[:i], 0
            while run < max_len and i + run < len(output) and _occurs(seen, output[i:i + run + 1]):
                run += 1
            i, steps = i + run + 1, steps + 1
        tokens += len(output) - 1
    return {"steps": steps, "tokens_per_step": round(tokens / max(1, steps), 2)}


def _occurs(tokens: list[int], run: list[int]) -> bool:
    n = len(run)
    return any(tokens[j:j + n] == run for j in range(len(tokens) - n + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("random", "grounded"), default="grounded")
    parser.add_argument("--record", action="store_true", help="record the greedy answers first (runs the model)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answers", default="", help="the recorded answers' file (default: bench/results/...)")
    parser.add_argument("--method", choices=METHODS[1:], default="suffix")
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    parser.add_argument("--draft-token-budget", type=int, default=24)
    parser.add_argument("--oracle", action="store_true",
                        help="also the bound of copying: the longest run found earlier, drafted every step")
    args = parser.parse_args()
    path = Path(args.answers or f"bench/results/answers-{args.workload}-{args.input_len}-{args.output_len}.json")
    if args.record:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record(args.workload, args.num_prompts, args.input_len, args.output_len,
                                          args.seed)))
    answers = json.loads(path.read_text())
    config = SpeculationConfig(args.method, args.max_draft_tokens, args.draft_token_budget)
    print(json.dumps({"answers": str(path), "method": args.method, **replay(answers, config,
                                                                            args.draft_token_budget - 1)}))
    if args.oracle:
        print(json.dumps({"answers": str(path), "method": "oracle", **oracle(answers, args.max_draft_tokens)}))


if __name__ == "__main__":
    main()
