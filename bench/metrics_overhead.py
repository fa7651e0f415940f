"""The Prometheus metrics' CPU cost, bounded from below the noise of a
throughput A/B: the CPU time (time.thread_time) of what the metrics path does,
called many times on fixed inputs — no chain, no model.

- per engine step: the scheduler's `EngineMetrics.on_step` for a decode step of
  `--sequences` running sequences (one token each: an inter-token latency, a
  queue wait, the step's size and duration, the token counters);
- per finished sequence: the scheduler's `on_finished` (request_success and the
  per-request histograms) and the edge's `EdgeMetrics.record` (its HTTP
  counter and duration histogram, one per request);
- per scrape: the scheduler's and the edge's `/metrics` text.

Added up per step, with `--sequences` / `--output-len` requests finishing in
an average decode step and one scrape every `--scrape-s`, and divided by a
step's duration (`--step-ms`: the measured decode step at that batch size, e.g.
`stormserve:step_duration_seconds` of the same machine), that is the share of
a step the metrics take. The bound is pessimistic: all of it is counted as if
it delayed the step, though the edge runs in another process and the scheduler
plans the next step while the worker computes this one.

    PYTHONPATH=gen:. .venv/bin/python -m bench.metrics_overhead --sequences 32 --step-ms 50
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

from prometheus_client import generate_latest

from services.http_edge.metrics import EdgeMetrics
from services.scheduler.engine import EngineLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.plan import ScheduledSequence, StepPlan, WorkerCapacity
from services.scheduler.policy import BatchPolicy
from services.scheduler.sequence import SamplingParams, Sequence, StoppingCriteria

MODEL = "bench"
CHAT = "/v1/chat/completions"


class MetricsPath:
    """One scheduler's and one edge's metrics, and the calls they get in steady
    decoding: `sequences` sequences, each `output_len` tokens into a reply of
    `output_len` after a `prompt_len` prompt, one step every `step_ms`."""

    def __init__(self, sequences: int, prompt_len: int, output_len: int, step_ms: float):
        self.step_us = round(step_ms * 1000)
        engine = EngineLoop(SimpleNamespace(address="worker:0"), sequences, 1024)
        engine.policy = BatchPolicy(WorkerCapacity(num_kv_blocks=4096, block_size=16, max_batch_size=sequences,
                                                   eos_token_ids=frozenset({2})), sequences, 1024)
        self.scheduler = SchedulerMetrics(MODEL, 4096, [engine])
        self.engine = engine.metrics = self.scheduler.engine()
        self.edge = EdgeMetrics()
        arrival_us = 1_000_000
        first_token_us = arrival_us + 2 * self.step_us
        self.now_us = first_token_us + (output_len - 1) * self.step_us
        self.seqs = [Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[10] * prompt_len,
                              sampling=SamplingParams(), stopping=StoppingCriteria(max_tokens=output_len),
                              arrival_us=arrival_us, output_token_ids=[11] * output_len,
                              first_scheduled_us=arrival_us + self.step_us, first_token_us=first_token_us,
                              last_event_us=self.now_us)
                     for i in range(sequences)]
        self.plan = StepPlan(1, [ScheduledSequence(seq, seq.num_tokens - 1, 1) for seq in self.seqs],
                             num_decodes=sequences)
        # Middle tokens of one-choice requests: packed, as postprocess counts them (no events).
        self.packed = {(sequences, self.step_us // 10, step_ms): sequences}

    def step(self) -> None:
        self.engine.on_step(self.plan, [], self.now_us - self.step_us, self.now_us, self.packed)

    def finish(self) -> None:
        self.engine.on_finished(self.seqs[0], "length", self.now_us)
        self.edge.record("POST", CHAT, 200, None, (self.now_us - self.seqs[0].arrival_us) * 1e-6)

    def scrape(self) -> None:
        generate_latest(self.scheduler.registry)
        generate_latest(self.edge.registry)


def cpu_us(call: Callable[[], None], repetitions: int, rounds: int) -> float:
    """CPU µs per call: the median over `rounds` of `repetitions` calls in a row."""
    per_call = []
    for _ in range(rounds):
        start = time.thread_time_ns()
        for _ in range(repetitions):
            call()
        per_call.append((time.thread_time_ns() - start) / repetitions / 1000)
    return statistics.median(per_call)


def measure(path: MetricsPath, repetitions: int, rounds: int) -> dict[str, float]:
    return {"step_us": cpu_us(path.step, repetitions, rounds),
            "finished_request_us": cpu_us(path.finish, repetitions, rounds),
            "scrape_us": cpu_us(path.scrape, max(1, repetitions // 100), rounds)}


def share_of_step(figures: dict[str, float], sequences: int, output_len: int, step_ms: float,
                  scrape_s: float) -> float:
    """The metrics' CPU per average decode step over the step's duration."""
    step_us = step_ms * 1000
    per_step = (figures["step_us"] + sequences / output_len * figures["finished_request_us"]
                + figures["scrape_us"] * step_us / (scrape_s * 1e6))
    return per_step / step_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32, help="running sequences (the streams)")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128, help="tokens per reply")
    parser.add_argument("--step-ms", type=float, required=True,
                        help="a decode step's duration at --sequences on the machine in question")
    parser.add_argument("--scrape-s", type=float, default=5.0, help="scrape interval")
    parser.add_argument("--repetitions", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    path = MetricsPath(args.sequences, args.prompt_len, args.output_len, args.step_ms)
    figures = measure(path, args.repetitions, args.rounds)
    share = share_of_step(figures, args.sequences, args.output_len, args.step_ms, args.scrape_s)
    print(json.dumps({**vars(args), **{k: round(v, 2) for k, v in figures.items()},
                      "share_of_step_pct": round(100 * share, 3)}))


if __name__ == "__main__":
    main()
