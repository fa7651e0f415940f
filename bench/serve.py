"""Serving benchmark for any OpenAI-compatible /v1/chat/completions endpoint.

A fixed, seeded synthetic dataset (no downloads); closed-loop concurrency
levels (`--concurrency 1,8,32`) and open-loop Poisson request rates
(`--rates 2,4`); per request: time to first token, inter-token latency and
end-to-end latency; per level: medians and percentiles and output tokens/s.
Results go to a JSON file and a printed table. The same command measures us
and a peer: point --base-url at either.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct \
        --concurrency 1,8 --num-requests 16 --input-len 200 --output-len 128

A level may carry its own number of requests: `--concurrency 1:8,32:32`.
`--start-chain` measures a chain of our own instead of --base-url: started on
free ports as `make run` starts it (services/common/supervisor.py), with the
environment's STORMSERVE_* settings and each `--chain-env NAME=VALUE` over
them (STORMSERVE_DEVICE=cuda, STORMSERVE_MODEL_PATH=..., say), measured once
/health answers, then stopped; its services' logs go to `--chain-log-dir`
and its scheduler's /metrics is read as with --metrics-url. `--groups N` starts
it with N serving groups (a scheduler and one worker each); every scheduler's
/metrics is then read.

`--turns T` makes each prompt a conversation of T turns: the next turn sends the
previous messages, the answer and a follow-up, so it shares its prefix with the
turn before (turns of one conversation run one after another; the concurrency
counts conversations). With a stormserve scheduler's /metrics, each level
reports the prefix-cache hit rate (hit / queried prompt tokens), the figure
that compares group choices:

    python -m bench.serve --start-chain --groups 2 --turns 3 --workload grounded \
        --concurrency 4:8 --output-len 32 --chain-env STORMSERVE_GROUP_POLICY=random
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import uvloop

from bench.grounded import make_grounded_prompts

if TYPE_CHECKING:  # the supervisor is imported only where a chain is started
    from services.common.supervisor import Chain

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point government company number group problem fact water light river city story music house").split()


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    """Seeded word salad; about 1.3 tokens per word for BPE vocabularies."""
    rng = random.Random(seed)
    words = max(1, int(input_len / 1.3))
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def level_prompts(n: int, input_len: int, seed: int, level: int, workload: str = "random") -> tuple[str, list[str]]:
    """A warm-up prompt and `n` measured ones, different for every level, so that
    no level (and no measured request) starts on another's prefix cache."""
    make = make_grounded_prompts if workload == "grounded" else make_prompts
    prompts = make(n + 1, input_len, seed + 1000 * level)
    return prompts[0], prompts[1:]


# The scheduler's counters read around a level: speculative decoding and steps.
SCHEDULER_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                      "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total",
                      "stormserve:step_batch_size_count")


PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
# Follow-up turns of a conversation (--turns), in turn.
FOLLOW_UPS = ("Now do the same again, but shorter.", "Check your answer against the text and correct it.",
              "Summarise what you did in one sentence.", "Do it once more, in the same format.")


def read_counters(metrics_url: str) -> dict[str, float]:
    """Sums over labels of SCHEDULER_COUNTERS and PREFIX_CACHE_COUNTERS at `metrics_url`
    (a scheduler's /metrics; a comma list of several: summed over them)."""
    import urllib.request

    totals = dict.fromkeys(SCHEDULER_COUNTERS + PREFIX_CACHE_COUNTERS, 0.0)
    for url in filter(None, metrics_url.split(",")):
        for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def prefix_cache_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens queried against the prefix cache and found in it over a level."""
    queried, hit = (after[name] - before[name] for name in PREFIX_CACHE_COUNTERS)
    return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else 0.0}


def speculation_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance rate (accepted / drafted tokens), tokens per verified draft (1 +
    accepted / drafts) and generated tokens per engine step over a level."""
    delta = {name: after[name] - before[name] for name in SCHEDULER_COUNTERS}
    drafts, drafted, accepted, generated, steps = (delta[name] for name in SCHEDULER_COUNTERS)
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_draft": 1 + accepted / drafts if drafts else 0.0,
            "tokens_per_step": generated / steps if steps else 0.0}


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    text: str = ""


class HTTPStatusError(Exception):
    """A response other than 200, with the start of its body."""


class _Dechunker:
    """Undoes HTTP/1.1 chunked transfer coding on data as it arrives."""

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # bytes of the current chunk still to come, then its CRLF
        self.is_done = False

    def feed(self, data: bytes) -> bytes:
        """The body bytes `data` completes; sets `is_done` after the last chunk."""
        buffer, out = self._buffer + data, []
        while buffer and not self.is_done:
            if self._left:
                take = buffer[:self._left]
                out.append(take)
                self._left -= len(take)
                buffer = buffer[len(take):]
                continue
            end = buffer.find(b"\n")
            if end < 0:
                break
            line, buffer = buffer[:end].strip(), buffer[end + 1:]
            if not line:
                continue  # the CRLF after a chunk's data
            size = int(line.split(b";")[0], 16)
            self._left, self.is_done = size, size == 0
        self._buffer = buffer
        return b"".join(out)


async def post_events(url: str, body: bytes) -> AsyncIterator[bytes]:
    """POST a JSON body; yield the data of each server-sent event streamed back.

    A minimal HTTP/1.1 client, one connection per request, reading whatever
    has arrived at each wake-up: the load generator shares the machine with
    the server it measures, and an HTTP library parsing each event in Python
    cost as much CPU as any one of our services. Answers chunked or plain
    bodies, `\n` or `\r\n` line ends, http and https."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80)
    reader, writer = await asyncio.open_connection(host, port, ssl=ssl.create_default_context() if secure else None)
    try:
        writer.write(f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                     .encode() + body)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        dechunker = _Dechunker() if "chunked" in headers.get("transfer-encoding", "") else None
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}: {(await reader.read(200 if not dechunker else 400))!r}")
        pending = b""
        while data := await reader.read(65536):
            if dechunker is not None:
                data = dechunker.feed(data)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
            if dechunker is not None and dechunker.is_done:
                break
    finally:
        writer.close()


async def one_request(url: str, args, prompt: str | list[dict]) -> RequestResult:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": args.model, "messages": messages, "stream": True,
            "max_tokens": args.output_len, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
        if args.eos_token_id is not None:  # peers without ignore_eos: suppress EOS by logit_bias
            body["logit_bias"] = {str(args.eos_token_id): -100}
    result = RequestResult()
    content_chunks = 0
    start = last = time.perf_counter()
    try:
        async with asyncio.timeout(args.timeout):
            async for data in post_events(url, json.dumps(body).encode()):
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    continue
                result.text += "".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"])
                content_chunks += 1
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except (OSError, ValueError, IndexError, TimeoutError, asyncio.IncompleteReadError, HTTPStatusError) as exc:
        result.error = repr(exc)
    # Servers that send no usage chunk (llama-cpp-python): one chunk per token.
    result.output_tokens = result.output_tokens or content_chunks
    result.e2e_s = time.perf_counter() - start
    return result


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": statistics.median(ordered), "p90": pick(0.9), "p99": pick(0.99),
            "mean": statistics.fmean(ordered)}


class Progress:
    def __init__(self, total: int, label: str):
        self.total, self.done, self.label = total, 0, label

    def tick(self) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        print(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}",
              end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)


async def run_level(args, warm_up: str, prompts: list[str], concurrency: int | None, rate: float | None) -> dict:
    label = f"concurrency {concurrency}" if concurrency else f"rate {rate}/s"
    turns = getattr(args, "turns", 1)
    progress = Progress(len(prompts) * turns, label)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    # Warm-up, excluded from the figures.
    await one_request(url, args, warm_up)
    gate = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(args.seed)

    async def worker(prompt: str, delay: float) -> list[RequestResult]:
        await asyncio.sleep(delay)
        results, messages = [], [{"role": "user", "content": prompt}]
        async with gate:
            for turn in range(turns):
                if turn:
                    messages += [{"role": "assistant", "content": results[-1].text},
                                 {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}]
                results.append(await one_request(url, args, list(messages)))
                progress.tick()
        return results

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate:
            t += rng.expovariate(rate)
    counters = read_counters(args.metrics_url) if args.metrics_url else None
    started, cpu_started = time.perf_counter(), time.process_time()
    conversations = await asyncio.gather(*(worker(p, d) for p, d in zip(prompts, delays)))
    results = [r for conversation in conversations for r in conversation]
    elapsed = time.perf_counter() - started
    client_cpu_s = time.process_time() - cpu_started
    ok = [r for r in results if not r.error]
    tokens = sum(r.output_tokens for r in ok)
    after = read_counters(args.metrics_url) if counters else None
    speculation = speculation_figures(counters, after) if counters else {}
    return {"speculation": speculation, "prefix_cache": prefix_cache_figures(counters, after) if counters else {},
        "turns": turns,
        "level": label, "concurrency": concurrency, "rate": rate, "requests": len(results),
        "errors": [r.error for r in results if r.error][:5], "num_errors": len(results) - len(ok),
        "duration_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
        "ttft_s": percentiles([r.ttft_s for r in ok]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        # The load generator's own CPU: on a small machine it shares the cores
        # with the server it measures.
        "client_cpu_s": client_cpu_s,
    }


def print_table(levels: list[dict]) -> None:
    header = f"{'level':<18}{'req':>5}{'err':>5}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p90':>10}" \
             f"{'ITL p50':>9}{'ITL p90':>9}{'E2E p50':>9}{'E2E p90':>9}{'client CPU':>12}{'cache hit':>10}"
    print(header)
    for lv in levels:
        client_cpu = f"{lv['client_cpu_s']:>11.2f}s" if "client_cpu_s" in lv else f"{'-':>12}"
        prefix_cache = lv.get("prefix_cache") or {}
        hit_rate = f"{prefix_cache['hit_rate']:>10.1%}" if prefix_cache else f"{'-':>10}"
        print(f"{lv['level']:<18}{lv['requests']:>5}{lv['num_errors']:>5}{lv['output_tok_per_s']:>9.1f}"
              f"{lv['ttft_s']['p50']:>9.3f}s{lv['ttft_s']['p90']:>9.3f}s"
              f"{lv['itl_s']['p50'] * 1000:>7.1f}ms{lv['itl_s']['p90'] * 1000:>7.1f}ms"
              f"{lv['e2e_s']['p50']:>8.2f}s{lv['e2e_s']['p90']:>8.2f}s{client_cpu}{hit_rate}")


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Throughput and latency against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, levels in runs.items():
        closed = [lv for lv in levels if lv["concurrency"]]
        xs = [lv["concurrency"] for lv in closed]
        ax_tps.plot(xs, [lv["output_tok_per_s"] for lv in closed], marker="o", label=label)
        for ax, key in ((ax_ttft, "ttft_s"), (ax_itl, "itl_s")):
            ax.plot(xs, [lv[key]["p50"] for lv in closed], marker="o", label=f"{label} p50")
            ax.plot(xs, [lv[key]["p90"] for lv in closed], marker="x", linestyle="--", label=f"{label} p90")
    for ax, title, unit in ((ax_tps, "output tokens/s", "tok/s"), (ax_ttft, "time to first token", "s"),
                            (ax_itl, "inter-token latency", "s")):
        ax.set_title(title)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_chain(settings: list[str], log_dir: str, timeout_s: float, groups: int = 1) -> Chain:
    """A chain on free ports with `settings` (NAME=VALUE) over the environment's, healthy;
    with `groups` serving groups of one worker each."""
    from services.common.supervisor import Chain, free_port

    env = dict(setting.split("=", 1) for setting in settings)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="bench-serve-chain-"))
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  worker_ports=[free_port() for _ in range(groups)],
                  group_scheduler_ports=[free_port() for _ in range(groups - 1)], env=env, log_dir=logs)
    print(f"starting a chain ({' '.join(settings) or 'settings from the environment'}); logs in {logs}",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    chain.start()
    try:
        chain.wait_ready(timeout_s=timeout_s)
        wait_groups_ready(chain, started + timeout_s)
    except BaseException:
        chain.stop()
        raise
    print(f"chain up in {time.monotonic() - started:.1f} s at {chain.url}", file=sys.stderr, flush=True)
    return chain


def wait_groups_ready(chain: Chain, deadline: float) -> None:
    """/health answers once one group serves: wait until every scheduler has a ready worker."""
    import grpc

    from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    for port in chain.scheduler_ports[1:]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            while stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5).num_workers_ready < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the scheduler on port {port} has no ready worker")
                time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--concurrency", default="1,8",
                        help="comma list of closed-loop levels, each `streams` or `streams:requests`")
    parser.add_argument("--rates", default="", help="comma list of open-loop request rates (req/s)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests per level")
    parser.add_argument("--input-len", type=int, default=200, help="approximate prompt tokens")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--workload", choices=("random", "grounded"), default="random",
                        help="random word prompts, or prompts that ask to repeat, edit or extract from a text")
    parser.add_argument("--metrics-url", default="",
                        help="a stormserve scheduler's /metrics: report draft acceptance and tokens per step")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--eos-token-id", type=int, default=None,
                        help="also suppress this id by logit_bias (for peers without ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="bench/results/latest.json")
    parser.add_argument("--label", default="server", help="name of this server in tables and plots")
    parser.add_argument("--compare", nargs="*", default=[],
                        help="earlier result JSON files to put in the same plot")
    parser.add_argument("--start-chain", action="store_true",
                        help="start a chain of our own on free ports and measure it instead of --base-url")
    parser.add_argument("--chain-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting of the started chain over the environment's (STORMSERVE_DEVICE=cuda)")
    parser.add_argument("--chain-log-dir", default="", help="the started chain's logs; empty = a temporary directory")
    parser.add_argument("--chain-timeout", type=float, default=600, help="seconds the started chain may take to start")
    parser.add_argument("--groups", type=int, default=1,
                        help="serving groups of the started chain (a scheduler and one worker each)")
    parser.add_argument("--turns", type=int, default=1,
                        help="turns per conversation: each next turn repeats the last with the answer and a "
                             "follow-up (its prefix)")
    args = parser.parse_args()
    plan = []
    for level in filter(None, args.concurrency.split(",")):
        streams, _, requests = level.partition(":")
        plan.append((int(streams), None, int(requests or args.num_requests)))
    plan += [(None, float(r), args.num_requests) for r in filter(None, args.rates.split(","))]
    chain = None
    if args.start_chain:
        # SIGTERM (a `timeout` around us) stops the chain as Ctrl-C does, rather than leaving it to its own.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        chain = start_chain(args.chain_env, args.chain_log_dir, args.chain_timeout, args.groups)
        args.base_url = chain.url
        args.metrics_url = args.metrics_url or ",".join(chain.metrics_urls[n] for n in chain.scheduler_names)
    levels = []
    try:
        for index, (concurrency, rate, num_requests) in enumerate(plan):
            warm_up, prompts = level_prompts(num_requests, args.input_len, args.seed, index, args.workload)
            # On uvloop: at 32 streams the client used about a third less CPU than on asyncio's loop.
            levels.append(uvloop.run(run_level(args, warm_up, prompts, concurrency, rate)))
    finally:
        if chain is not None:
            chain.stop()
    print_table(levels)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "levels": levels}, indent=2))
    runs = {args.label: levels}
    for other in args.compare:
        data = json.loads(Path(other).read_text())
        runs[data["args"].get("label", other)] = data["levels"]
    plot(runs, out.with_suffix(".png"))
    print(f"results: {out} and {out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
