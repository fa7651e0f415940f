"""How many steps a second one scheduler plans: the real scheduler process
(`python -m services.scheduler`) driving simulated workers that answer every
step at once, fed through its own gRPC API as the tokenizer feeds it.

- The workers are one process (this one): one grpc.aio server bound to a port
  per worker, serving WorkerService (Describe, StepStream) and the health
  service, and one step channel port that all of them report in Describe (a
  scheduler from before the step channel sends steps on StepStream). Each step is answered with a real StepResponse of the right shape:
  a token per sequence that samples (in the packed columns where the step asks,
  as a real worker answers tokens without logprobs), in request order, its step_id
  echoed. Nothing is computed; the answer's bytes are cached per set of
  sequences, so a worker's cost per step is parsing the request.
- The requests come on GenerateStreams (one per 256 calls, at most 16), as tokenizers send them
  (plain tokens packed, PackedTokens): W x S
  calls with `--prompt-len` random tokens, `ignore_eos` and `--max-tokens`;
  a call that ends is started again at once, so every worker keeps S sequences.
- The scheduler is found as it finds workers locally: the static
  `worker_addresses` setting (STORMSERVE_WORKER_ADDRESSES), with maxBatchSize S.

Per point (W workers x S sequences each), after the warm-up (every call
admitted, said every 5 s while it goes and reported as `admit_s`; then
`--warmup-s` more), `--repeats` windows of `--seconds`: steps/s of
all workers together (GetLoad's num_steps), tokens/s delivered to the caller,
the scheduler's process CPU time (all its threads, from /proc) per step in µs,
and both processes' CPU use in % of one core. The figures are the medians over
the windows. This process (workers and caller) shares the machine's cores with
the scheduler: where it is near 100 %, the scheduler waited on it, and its CPU
per step, not the steps/s, is the figure to read.

    PYTHONPATH=gen:. .venv/bin/python -m bench.scheduler_throughput
    PYTHONPATH=gen:. .venv/bin/python -m bench.scheduler_throughput --workers 16 --sequences 64 \\
        --tree before=/tmp/before --tree after=. --rounds 3        # A/B, order alternating per round
    PYTHONPATH=gen:. .venv/bin/python -m bench.scheduler_throughput --workers 16 --sequences 64 \\
        --profile /tmp/scheduler.prof                              # the scheduler under cProfile
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.frames import frame, read_frame
from services.common.supervisor import free_port
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from stormserve.worker.v1 import worker_pb2

ROOT = Path(__file__).resolve().parent.parent
TOKEN_ID = 1000  # what every simulated step samples (never an EOS)
EOS_TOKEN_ID = 2
VOCAB_SIZE = 32000
WORKER_SERVICE = "stormserve.worker.v1.WorkerService"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class SimulatedWorkers:
    """`num_workers` workers on one grpc.aio server, one port each; every step
    answered at once with one sampled token per sampling sequence."""

    def __init__(self, num_workers: int, block_size: int, num_kv_blocks: int, max_batch_size: int):
        self.description = worker_pb2.DescribeResponse(
            model_path="simulated", vocab_size=VOCAB_SIZE, eos_token_ids=[EOS_TOKEN_ID],
            max_position_embeddings=1 << 20, device="cpu", dtype="bfloat16", num_kv_blocks=num_kv_blocks,
            block_size=block_size, max_batch_size=max_batch_size, holds_block_tables=True, max_decode_steps=64)
        self.num_workers = num_workers
        self.num_steps = 0
        self.num_tokens = 0
        self._answers: dict[tuple[bool, tuple[int, ...]], bytes] = {}  # (packed, sampled seq ids) -> the tokens' bytes
        self.server: grpc.aio.Server | None = None  # made on the running loop, by start
        self.steps: asyncio.Server | None = None
        self.addresses: list[str] = []

    def answer(self, raw: bytes) -> bytes:
        """The StepStreamResponse to a StepStreamRequest, both serialized: with
        decode_steps, the decodes by id sample again in each step after the first."""
        step = worker_pb2.StepStreamRequest.FromString(raw).step
        decodes = tuple(step.decode_seq_ids)
        sampling = decodes + tuple(s.seq_id for s in step.sequences if s.sample) + decodes * (step.decode_steps - 1)
        key = (step.pack_plain_tokens, sampling)
        tokens = self._answers.get(key)
        if tokens is None:
            if len(self._answers) > 4096:
                self._answers.clear()
            if step.pack_plain_tokens:  # as a real worker answers tokens without logprobs or drafts
                answer = worker_pb2.StepResponse(plain_seq_ids=sampling, plain_token_ids=[TOKEN_ID] * len(sampling))
            else:
                answer = worker_pb2.StepResponse(
                    tokens=[worker_pb2.SampledToken(seq_id=i, token_id=TOKEN_ID) for i in sampling])
            tokens = self._answers[key] = answer.SerializeToString()
        # Serialized messages concatenate as a merge: step_id first, then the tokens.
        body = worker_pb2.StepResponse(step_id=step.step_id).SerializeToString() + tokens
        self.num_steps += max(1, step.decode_steps)
        self.num_tokens += len(sampling)
        return b"\x0a" + _varint(len(body)) + body

    async def _step_stream(self, requests, context):
        async for raw in requests:
            yield self.answer(raw)

    async def _describe(self, request, context):
        return self.description

    async def _step_channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Every worker's step channel (one port: the answers depend on nothing but the step)."""
        try:
            while (raw := await read_frame(reader)) is not None:
                writer.write(frame(self.answer(raw)))
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def start(self, host: str = "127.0.0.1") -> None:
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        handlers = {
            "Describe": grpc.unary_unary_rpc_method_handler(
                self._describe, request_deserializer=worker_pb2.DescribeRequest.FromString,
                response_serializer=worker_pb2.DescribeResponse.SerializeToString),
            "StepStream": grpc.stream_stream_rpc_method_handler(self._step_stream),  # bytes in, bytes out
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WORKER_SERVICE, handlers),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        for _ in range(self.num_workers):
            port = self.server.add_insecure_port(f"{host}:0")
            self.addresses.append(f"{host}:{port}")
        self.steps = await asyncio.start_server(self._step_channel, host, 0)
        self.description.step_port = self.steps.sockets[0].getsockname()[1]
        await self.server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        if self.steps is not None:
            self.steps.close()
        if self.server is not None:
            await self.server.stop(0)


class Caller:
    """Keeps `num_calls` Generate calls running on one GenerateStream, as the tokenizer would."""

    def __init__(self, stub, num_calls: int, prompt_len: int, max_tokens: int, seed: int = 0, name: str = "bench"):
        self.stub = stub
        self.name = name
        self.num_calls = num_calls
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.num_tokens = 0
        self.num_ended = 0
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._reader: asyncio.Task | None = None

    def _start_one(self) -> None:
        call_id = next(self._ids)
        request = scheduler_pb2.GenerateRequest(
            request_id=f"{self.name}-{call_id}",
            prompt_token_ids=[self.rng.randrange(3, VOCAB_SIZE) for _ in range(self.prompt_len)],
            sampling=scheduler_pb2.SamplingParams(temperature=0.0),
            stopping=scheduler_pb2.StoppingCriteria(max_tokens=self.max_tokens, ignore_eos=True))
        self._outgoing.put_nowait(scheduler_pb2.GenerateStreamRequest(call_id=call_id, start=request,
                                                                      packed_tokens=True, packed_token_runs=True))

    async def _requests(self):
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        async for reply in self._call:
            self.num_tokens += len(reply.tokens.call_ids)  # packed (a tree from before reads them as events)
            for event in reply.events:
                if event.WhichOneof("event") == "end":
                    self.num_ended += 1
                    if event.end.code != 0 and len(self.errors) < 10:
                        self.errors.append(f"{event.end.code}: {event.end.message}")
                    self._start_one()
                else:
                    self.num_tokens += len(event.response.tokens)

    def start(self) -> None:
        self._call = self.stub.GenerateStream(self._requests())
        for _ in range(self.num_calls):
            self._start_one()
        self._reader = asyncio.create_task(self._read())

    async def stop(self) -> None:
        self._outgoing.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@dataclass(frozen=True)
class Point:
    num_workers: int
    num_sequences: int  # per worker


def scheduler_env(tree: Path, port: int, addresses: list[str], point: Point, args,
                  decode_steps: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STORMSERVE_", "OTEL_"))}
    gen = tree / "gen" if (tree / "gen").is_dir() else ROOT / "gen"
    env.update({
        "PYTHONPATH": f"{gen}:{tree}",
        "STORMSERVE_HOST": "127.0.0.1",
        "STORMSERVE_PORT": str(port),
        "STORMSERVE_WORKER_ADDRESSES": ",".join(addresses),
        "STORMSERVE_MAX_BATCH_SIZE": str(point.num_sequences),
        "STORMSERVE_MAX_SEQ_LEN": str(args.prompt_len + args.max_tokens + 1),
        "STORMSERVE_MAX_ITER_TIMES": str(args.max_tokens),
        "STORMSERVE_MAX_QUEUE_SIZE": str(2 * point.num_workers * point.num_sequences + 16),
        "STORMSERVE_METRICS_PORT": str(free_port() if args.metrics else 0),
        "STORMSERVE_DRAIN_TIMEOUT_S": "2",
        "STORMSERVE_LOG_LEVEL": "WARNING",
    })
    if decode_steps > 1:  # a tree from before has no such setting
        env["STORMSERVE_MAX_DECODE_STEPS"] = str(decode_steps)
    return env


def planning_totals(metrics_port: int) -> tuple[float, float] | None:
    """(seconds, steps) of stormserve:step_planning_seconds over every worker's
    series; None from a scheduler without it (an older tree)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = None
    for family in text_string_to_metric_families(text):
        if family.name == "stormserve:step_planning_seconds":
            found = (sum(s.value for s in family.samples if s.name.endswith("_sum")),
                     sum(s.value for s in family.samples if s.name.endswith("_count")))
    return found


def start_scheduler(tree: Path, env: dict[str, str], profile: str | None) -> subprocess.Popen:
    command = [sys.executable]
    if profile:
        command += ["-m", "cProfile", "-o", profile]
    command += ["-m", "services.scheduler"]
    return subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL)


async def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the scheduler exited ({process.returncode}) while waiting for {what}")
        with contextlib.suppress(grpc.aio.AioRpcError):
            if await predicate():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s} s")
        await asyncio.sleep(0.05)


async def run_point(point: Point, args, tree: Path = ROOT, profile: str | None = None, decode_steps: int = 1) -> dict:
    blocks_per_seq = -(-(args.prompt_len + args.max_tokens) // args.block_size)
    workers = SimulatedWorkers(point.num_workers, args.block_size,
                               num_kv_blocks=point.num_sequences * blocks_per_seq + 16,
                               max_batch_size=point.num_sequences)
    await workers.start()
    port = free_port()
    env = scheduler_env(tree, port, workers.addresses, point, args, decode_steps)
    metrics_port = int(env["STORMSERVE_METRICS_PORT"])
    process = start_scheduler(tree, env, profile)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    # Several streams, as several tokenizers would send: a busy scheduler reads one
    # start message per stream at a time, so one stream admits thousands of calls slowly.
    num_calls = point.num_workers * point.num_sequences
    num_streams = max(1, min(args.max_streams, num_calls // args.calls_per_stream))
    callers = [Caller(stub, num_calls // num_streams + (i < num_calls % num_streams), args.prompt_len,
                      args.max_tokens, seed=i, name=f"bench{i}") for i in range(num_streams)]
    try:
        async def all_ready() -> bool:
            load = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=2)
            return load.num_workers_ready == point.num_workers

        await wait_for(all_ready, 60, "ready workers", process)
        for caller in callers:
            caller.start()

        admit_started = last_said = time.monotonic()

        async def all_running() -> bool:
            nonlocal last_said
            load = await stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
            if time.monotonic() - last_said >= 5:
                last_said = time.monotonic()
                print(f"{point}: {load.num_running} of {num_calls} calls running after "
                      f"{last_said - admit_started:.0f} s", file=sys.stderr, flush=True)
            return load.num_running >= num_calls

        await wait_for(all_running, args.admit_timeout_s, "running sequences", process)
        admit_s = time.monotonic() - admit_started
        await asyncio.sleep(args.warmup_s)
        scheduler, bench = psutil.Process(process.pid), psutil.Process()
        windows = []
        for _ in range(args.repeats):
            planning_before = planning_totals(metrics_port) if metrics_port else None
            before = (time.monotonic(), (await stub.GetLoad(scheduler_pb2.GetLoadRequest())).num_steps,
                      sum(c.num_tokens for c in callers), cpu_seconds(scheduler), cpu_seconds(bench))
            await asyncio.sleep(args.seconds)
            after = (time.monotonic(), (await stub.GetLoad(scheduler_pb2.GetLoadRequest())).num_steps,
                     sum(c.num_tokens for c in callers), cpu_seconds(scheduler), cpu_seconds(bench))
            wall, steps, tokens, scheduler_cpu, bench_cpu = (a - b for a, b in zip(after, before))
            window = {
                "steps_per_s": steps / wall,
                "tokens_per_s": tokens / wall,
                "scheduler_cpu_us_per_step": scheduler_cpu / max(steps, 1) * 1e6,
                "scheduler_cpu_pct": 100 * scheduler_cpu / wall,
                "bench_cpu_pct": 100 * bench_cpu / wall,
            }
            if planning_before is not None:
                seconds, planned = (a - b for a, b in zip(planning_totals(metrics_port) or (0, 0), planning_before))
                window["planning_us_per_step"] = seconds / max(planned, 1) * 1e6
            windows.append(window)
        errors = [e for c in callers for e in c.errors]
        if errors:
            raise RuntimeError(f"calls failed: {errors[:10]}")
    finally:
        for caller in callers:
            await caller.stop()
        await channel.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.get_running_loop().run_in_executor(None, process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        await workers.stop()
    result = {"workers": point.num_workers, "sequences_per_worker": point.num_sequences, "streams": num_streams,
              "admit_s": round(admit_s, 1)}
    for key in windows[0]:
        values = sorted(w[key] for w in windows)
        result[key] = round(statistics.median(values), 1)
    result["steps_per_s_range"] = [round(windows_min, 1) for windows_min in
                                   (min(w["steps_per_s"] for w in windows), max(w["steps_per_s"] for w in windows))]
    result["windows"] = len(windows)
    return result


COLUMNS = (("tree", "tree"), ("workers", "W"), ("sequences_per_worker", "S"), ("steps_per_s", "steps/s"),
           ("tokens_per_s", "tokens/s"), ("scheduler_cpu_us_per_step", "sched CPU µs/step"),
           ("planning_us_per_step", "planning µs/step"), ("admit_s", "all running after s"),
           ("scheduler_cpu_pct", "sched CPU %"), ("bench_cpu_pct", "bench CPU %"), ("error", "error"))


def table(rows: list[dict]) -> str:
    columns = [(key, title) for key, title in COLUMNS if any(key in r for r in rows)]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(key, "")) for key, _ in columns) + " |")
    return "\n".join(lines)


def ab_summary(rows: list[dict], trees: list[str]) -> str:
    """Per point and tree: the medians over rounds, and each tree's steps/s and CPU
    per step over the first tree's (the median of the per-round ratios)."""
    lines = ["| W | S | tree | steps/s | sched CPU µs/step | steps/s ratio | CPU/step ratio |",
             "|---|---|---|---|---|---|---|"]
    points = sorted({(r["workers"], r["sequences_per_worker"]) for r in rows})
    for workers, seqs in points:
        at = [r for r in rows if (r["workers"], r["sequences_per_worker"]) == (workers, seqs) and "error" not in r]
        base = {r["round"]: r for r in at if r["tree"] == trees[0]}
        for tree in trees:
            mine = [r for r in at if r["tree"] == tree and r["round"] in base]
            if not mine:
                lines.append(f"| {workers} | {seqs} | {tree} | failed | | | |")
                continue
            steps = statistics.median(r["steps_per_s"] for r in mine)
            cpu = statistics.median(r["scheduler_cpu_us_per_step"] for r in mine)
            steps_ratio = statistics.median(r["steps_per_s"] / base[r["round"]]["steps_per_s"] for r in mine)
            cpu_ratio = statistics.median(r["scheduler_cpu_us_per_step"] / base[r["round"]]["scheduler_cpu_us_per_step"]
                                          for r in mine)
            lines.append(f"| {workers} | {seqs} | {tree} | {steps:.0f} | {cpu:.0f} | x{steps_ratio:.2f} | "
                         f"x{cpu_ratio:.2f} |")
    return "\n".join(lines)


def parse_tree(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError("a tree is NAME=PATH")
    return name, Path(path).resolve()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 8, 16, 32], help="worker counts")
    p.add_argument("--sequences", type=int, nargs="+", default=[8, 64, 256], help="sequences per worker")
    p.add_argument("--seconds", type=float, default=1.0, help="length of one measured window")
    p.add_argument("--repeats", type=int, default=3, help="measured windows per point (their median is reported)")
    p.add_argument("--warmup-s", type=float, default=0.5, help="seconds after every call is running, not measured")
    p.add_argument("--admit-timeout-s", type=float, default=120.0,
                   help="a point whose calls are not all running by then is reported as failed")
    p.add_argument("--calls-per-stream", type=int, default=256,
                   help="GenerateStreams opened: one per this many calls (as many tokenizers), at most --max-streams")
    p.add_argument("--max-streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048, help="each call's; an ended call starts again")
    p.add_argument("--block-size", type=int, default=128, help="the simulated workers' KV block size (tokens)")
    p.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="run the scheduler with its /metrics off (on by default, as deployed)")
    p.add_argument("--tree", type=parse_tree, action="append", default=[],
                   help="NAME=PATH: run the scheduler from this checkout (several: A/B, alternating order)")
    p.add_argument("--decode-steps", type=int, nargs="+", default=[1],
                   help="the scheduler's max_decode_steps (several: each tree with each, named TREE kN)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over the trees (A/B)")
    p.add_argument("--profile", help="write the scheduler's cProfile stats here (one tree, one point)")
    p.add_argument("--out", help="also write the JSON lines here")
    return p.parse_args(argv)


def variants(args: argparse.Namespace) -> list[tuple[str, Path, int]]:
    """(name, tree, max_decode_steps) of each scheduler to run at every point."""
    trees = args.tree or [("this", ROOT)]
    several = len(args.decode_steps) > 1
    return [(f"{name} k{steps}" if several else name, path, steps) for name, path in trees for steps in args.decode_steps]


async def run(args: argparse.Namespace) -> list[dict]:
    schedulers = variants(args)
    points = [Point(w, s) for w in args.workers for s in args.sequences]
    if args.profile and (len(points) > 1 or len(schedulers) > 1):
        raise SystemExit("--profile takes one point and one tree")
    rows = []
    for round_index in range(args.rounds):
        for point in points:
            order = schedulers if round_index % 2 == 0 else schedulers[::-1]
            for name, path, decode_steps in order:
                row = {"tree": name, "round": round_index}
                try:
                    row.update(await run_point(point, args, path, args.profile, decode_steps))
                except (TimeoutError, RuntimeError) as exc:  # reported; the other points still run
                    row.update(workers=point.num_workers, sequences_per_worker=point.num_sequences, error=str(exc))
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(table(rows))
    if len({r["tree"] for r in rows}) > 1:
        print()
        print(ab_summary(rows, [name for name, _, _ in variants(args)]))


if __name__ == "__main__":
    main()
