"""Prefill/decode disaggregation against a colocated chain, on the same cores.

Two chains on the bundled model, both up at once: `colocated`, one worker of
role both on all the cores (`--cores` threads), and `1P1D`, a prefill and a
decode worker (Chain worker_roles, as STORMSERVE_DISAGGREGATE=1P1D starts
them) on half the cores each. Each run puts `streams` streaming chats on a
chain (short prompts, `--stream-output-len` tokens each, restarted as they
end) and, while they decode, a long prompt of `--long-input-len` tokens every
`--long-every-s` seconds (each distinct: no prefix hits), for `--seconds`
seconds and until the last long prompt has answered; then the streams are cut.

    PYTHONPATH=gen:. .venv/bin/python -m bench.disaggregation --levels 16 --rounds 2 --seconds 45

Rounds alternate which chain goes first; both chains of a round get the same
prompts (each has its own caches). Per level and chain it prints the medians
over rounds of: the streams' ITL p50, p90 and p99 (gaps between SSE content
chunks, as bench.serve measures them; a prefill stalls the decodes for a few
steps in hundreds, so it shows at p99 before p90), their TTFT p50, the long
prompts' TTFT p50 and p90, output tokens/s (every request's tokens over the
run) and all tokens/s (prompt and output tokens the scheduler counted over
the run: the work done, the long prompts most of it); beside each, the median
of the per-round ratios 1P1D / colocated. From the 1P1D scheduler's /metrics
it reports the transfers: blocks moved (bytes over one block's bytes), bytes
and seconds per block (the SendBlocks duration histogram's sum over the
blocks). JSON per run under `--out-dir`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import uvloop

from bench.serve import WORDS, percentiles, post_events

COLOCATED, SPLIT = "colocated", "1P1D"
TOKEN_SERIES = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
TRANSFER_SERIES = ("stormserve:kv_transfer_bytes_total", "stormserve:kv_transfer_duration_seconds_sum",
                   "stormserve:kv_transfer_duration_seconds_count")
OUTCOMES = ("sent", "retried", "recomputed", "kept")


# --- prompts -----------------------------------------------------------------------------------

def words_for(tokens: int, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word))


def prompts(n: int, words: int, seed: int, tag: str) -> list[str]:
    """`n` seeded word-salad prompts of `words` words, each opening with its own tag and seed
    (no two share a first block), different for every seed."""
    rng = random.Random(seed)
    return [f"{tag} {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def tokens_per_word() -> float:
    """The bundled tokenizer's tokens per word of the word salad (chat template left out)."""
    from transformers import AutoTokenizer

    from services.common.model_files import default_model_path, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    sample = prompts(4, 500, 0, "x")
    return statistics.fmean(len(tokenizer(p)["input_ids"]) / 500 for p in sample)


# --- one request, its chunks timed ---------------------------------------------------------------

async def request(url: str, model: str, prompt: str, max_tokens: int, record: dict) -> None:
    """Stream one greedy chat (ignore_eos); into `record`: ttft_s, the gaps between content
    chunks (itl_s), tokens (the usage chunk's, or the content chunks so far if cut) and done."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    record.update(ttft_s=None, itl_s=[], chunks=0, tokens=0, done=False, error="")
    start = last = time.perf_counter()
    try:
        async for data in post_events(url, body):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                record["tokens"] = chunk["usage"]["completion_tokens"]
            if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                continue
            now = time.perf_counter()
            if record["ttft_s"] is None:
                record["ttft_s"] = now - start
            else:
                record["itl_s"].append(now - last)
            last = now
            record["chunks"] += 1
        record["done"] = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001  (reported with the run, not fatal)
        record["error"] = repr(exc)
    finally:
        record["tokens"] = record["tokens"] or record["chunks"]


async def run_mix(base_url: str, model: str, stream_prompts: list[str], long_prompts: list[str], args) -> dict:
    """The streams and the long prompts on one chain; the run's figures."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    streams: list[dict] = []
    longs: list[dict] = []
    stop = asyncio.Event()
    pending = iter(stream_prompts)

    async def stream_loop(first: str) -> None:
        prompt = first
        while not stop.is_set():
            record = {"kind": "stream"}
            streams.append(record)
            await request(url, model, prompt, args.stream_output_len, record)
            prompt = next(pending, None) or first + " again"

    async def long_one(prompt: str, delay: float) -> None:
        await asyncio.sleep(delay)
        record = {"kind": "long", "at_s": delay}
        longs.append(record)
        await request(url, model, prompt, args.long_output_len, record)

    started = time.perf_counter()
    stream_tasks = [asyncio.create_task(stream_loop(next(pending))) for _ in range(args.streams_now)]
    delays = [args.long_first_s + i * args.long_every_s for i in range(len(long_prompts))]
    await asyncio.gather(*(long_one(p, d) for p, d in zip(long_prompts, delays)))
    await asyncio.sleep(max(0.0, args.seconds - (time.perf_counter() - started)))
    stop.set()
    elapsed = time.perf_counter() - started
    for task in stream_tasks:
        task.cancel()
    await asyncio.gather(*stream_tasks, return_exceptions=True)
    ok_streams = [r for r in streams if not r["error"] and r["ttft_s"] is not None]
    ok_longs = [r for r in longs if not r["error"] and r["ttft_s"] is not None]
    return {
        "seconds": elapsed, "streams": args.streams_now, "stream_requests": len(streams),
        "long_prompts": len(longs), "errors": [r["error"] for r in streams + longs if r["error"]][:5],
        "output_tokens": sum(r["tokens"] for r in streams + longs),
        "tok_s": sum(r["tokens"] for r in streams + longs) / elapsed,
        "itl_s": percentiles([x for r in ok_streams for x in r["itl_s"]]),
        "stream_ttft_s": percentiles([r["ttft_s"] for r in ok_streams]),
        "long_ttft_s": percentiles([r["ttft_s"] for r in ok_longs]),
        "long_ttfts_s": [round(r["ttft_s"], 3) for r in ok_longs],
    }


# --- the chains ----------------------------------------------------------------------------------

def start_chains(args, work: Path) -> dict:
    from services.common.supervisor import Chain, free_port

    common = {"STORMSERVE_KV_CACHE_MIB": str(args.kv_cache_mib), "STORMSERVE_MAX_SEQ_LEN": str(args.max_seq_len),
              "STORMSERVE_MAX_INPUT_TOKEN_LEN": str(args.max_seq_len)}
    cores = args.cores or len(os.sched_getaffinity(0))
    specs = {COLOCATED: (["both"], cores), SPLIT: (["prefill", "decode"], max(1, cores // 2))}
    chains = {}
    for name, (roles, threads) in specs.items():
        chains[name] = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                             worker_ports=[free_port() for _ in roles], worker_roles=roles if len(roles) > 1 else [],
                             env={**common, "STORMSERVE_NUM_THREADS": str(threads)}, log_dir=work / f"logs-{name}")
        print(f"{name}: {len(roles)} worker(s) ({', '.join(roles)}), {threads} thread(s) each", file=sys.stderr)
    return chains


def wait_workers(chain, count: int, timeout_s: float) -> None:
    import grpc

    from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{chain.scheduler_port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5).num_workers_ready < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} workers ready")
            time.sleep(0.5)


def wait_idle(chain, timeout_s: float = 120) -> None:
    """Until the chain's scheduler runs and queues nothing (the cut streams aborted)."""
    import grpc

    from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{chain.scheduler_port}") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while (load := stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)).num_running + load.num_waiting:
            if time.monotonic() > deadline:
                print(f"warning: still {load.num_running} running after {timeout_s:.0f} s", file=sys.stderr)
                return
            time.sleep(0.3)


def read_counters(metrics_url: str) -> dict[str, float]:
    """The scheduler's token counters and KV transfer series at `metrics_url`."""
    return parse_counters(urllib.request.urlopen(metrics_url, timeout=10).read().decode())


def parse_counters(text: str) -> dict[str, float]:
    """The token counters and KV transfer series of a /metrics page, summed over labels; outcomes apart."""
    found = dict.fromkeys(TOKEN_SERIES + TRANSFER_SERIES + tuple(f"outcome:{o}" for o in OUTCOMES), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in found:
            found[name] += float(line.rsplit(" ", 1)[1])
        elif name == "stormserve:kv_transfers_total":
            outcome = re.search(r'outcome="([^"]+)"', line)
            if outcome and f"outcome:{outcome.group(1)}" in found:
                found[f"outcome:{outcome.group(1)}"] += float(line.rsplit(" ", 1)[1])
    return found


def transfer_figures(before: dict[str, float], after: dict[str, float], block_bytes: int) -> dict[str, float]:
    """Blocks moved over a run (bytes / one block's bytes), bytes and seconds per block, transfers."""
    delta = {k: after[k] - before[k] for k in before}
    moved = delta["stormserve:kv_transfer_bytes_total"]
    blocks = moved / block_bytes if block_bytes else 0.0
    seconds = delta["stormserve:kv_transfer_duration_seconds_sum"]
    count = delta["stormserve:kv_transfer_duration_seconds_count"]
    return {"bytes": moved, "blocks": blocks, "transfers": count,
            "bytes_per_block": moved / blocks if blocks else 0.0,
            "ms_per_block": 1000 * seconds / blocks if blocks else 0.0,
            "ms_per_transfer": 1000 * seconds / count if count else 0.0,
            **{o: delta[f"outcome:{o}"] for o in OUTCOMES}}


def transfer_line(transfers: list[dict], block_bytes: int) -> str:
    """The KV transfers of the 1P1D runs in a line: the medians over the runs that moved blocks."""
    moved = [t for t in transfers if t["blocks"] and t["transfers"]]
    median = lambda key: statistics.median(t[key] for t in moved)  # noqa: E731
    blocks_each = statistics.median(t["blocks"] / t["transfers"] for t in moved)
    outcomes = ", ".join(f"{o} {sum(t[o] for t in transfers):.0f}" for o in OUTCOMES)
    return (f"KV transfers (1P1D, medians of {len(moved)} runs): {median('ms_per_block'):.2f} ms per block of "
            f"{block_bytes:,} bytes ({block_bytes / 1e6 / (median('ms_per_block') / 1000):.0f} MB/s), "
            f"{median('ms_per_transfer'):.0f} ms per transfer of {blocks_each:.0f} blocks; outcomes: {outcomes}")


def block_bytes_of(log_dir: Path) -> int:
    """One KV block's bytes, from the worker's log line 'KV cache: N blocks x B tokens ... P bytes per token'."""
    for path in sorted(log_dir.glob("worker*")):
        match = re.search(r"KV cache: \d+ blocks x (\d+) tokens .*?(\d+) bytes per token", path.read_text())
        if match:
            return int(match.group(1)) * int(match.group(2))
    return 0


# --- the table -----------------------------------------------------------------------------------

FIGURES = (("itl_s", "p50", "ITL p50", 1000, "ms"), ("itl_s", "p90", "ITL p90", 1000, "ms"),
           ("itl_s", "p99", "ITL p99", 1000, "ms"),
           ("stream_ttft_s", "p50", "stream TTFT p50", 1, "s"), ("long_ttft_s", "p50", "long TTFT p50", 1, "s"),
           ("long_ttft_s", "p90", "long TTFT p90", 1, "s"), ("tok_s", None, "tok/s", 1, ""),
           ("all_tok_s", None, "all tok/s", 1, ""))


def value(run: dict, key: str, q: str | None) -> float:
    return run[key] if q is None else run[key][q]


def summary(results: dict[tuple[int, str], list[dict]]) -> list[dict]:
    """Per level and chain: the medians over rounds, and 1P1D's per-round ratios to colocated."""
    rows = []
    for (streams, name), runs in sorted(results.items()):
        row = {"streams": streams, "chain": name, "rounds": len(runs)}
        base = results.get((streams, COLOCATED), [])
        for key, q, label, scale, _ in FIGURES:
            row[label] = statistics.median(value(r, key, q) for r in runs) * scale
            if name == SPLIT and base:
                row[f"{label} ratio"] = statistics.median(
                    value(r, key, q) / value(b, key, q) for r, b in zip(runs, base) if value(b, key, q))
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| streams | chain | " + " | ".join(f[2] for f in FIGURES) + " |")
    print("|---|---|" + "---|" * len(FIGURES))
    for row in rows:
        cells = []
        for _, _, label, _, unit in FIGURES:
            text = f"{row[label]:.{0 if unit == 'ms' or label.endswith('tok/s') else 2}f}{(' ' + unit) if unit else ''}"
            if f"{label} ratio" in row:
                text += f" (×{row[f'{label} ratio']:.2f})"
            cells.append(text)
        print(f"| {row['streams']} | {row['chain']} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="16,32", help="streaming decodes per run, comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=45, help="each run's length (longer if a long prompt "
                                                                 "has not answered by then)")
    parser.add_argument("--warmup-s", type=float, default=8, help="each chain's warm-up run, not measured")
    parser.add_argument("--long-input-len", type=int, default=4000, help="the long prompts' tokens (about)")
    parser.add_argument("--long-every-s", type=float, default=15, help="seconds between long prompts")
    parser.add_argument("--long-first-s", type=float, default=3, help="the first long prompt's delay")
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--stream-input-len", type=int, default=100)
    parser.add_argument("--stream-output-len", type=int, default=256, help="each stream request's tokens; "
                                                                         "a stream restarts when one ends")
    parser.add_argument("--cores", type=int, default=0, help="threads of the colocated worker, half to each "
                                                             "of 1P1D's (0: the cores this process may use)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="each worker's KV pool")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--out-dir", default="")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="bench-disaggregation-"))
    work.mkdir(parents=True, exist_ok=True)
    per_word = tokens_per_word()
    long_words = words_for(args.long_input_len, per_word)
    stream_words = words_for(args.stream_input_len, per_word)
    num_long = int(max(0.0, args.seconds - args.long_first_s) // args.long_every_s) + 1
    print(f"{per_word:.2f} tokens per word: long prompts {long_words} words, {num_long} a run", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chains = start_chains(args, work)
    results: dict[tuple[int, str], list[dict]] = {}
    transfers: list[dict] = []
    try:
        for chain in chains.values():
            chain.start()
        for name, chain in chains.items():
            chain.wait_ready(timeout_s=900)
            wait_workers(chain, len(chain.worker_ports), 900)
        block_bytes = block_bytes_of(work / f"logs-{SPLIT}")
        for name, chain in chains.items():  # warm-up: the largest level's streams and a long prompt, not measured
            warm = argparse.Namespace(**{**vars(args), "streams_now": max(levels), "seconds": args.warmup_s,
                                         "long_first_s": 0})
            run = uvloop.run(run_mix(chain.url, args.model, prompts(4 * max(levels), stream_words, 1, "Warm"),
                                     prompts(1, long_words, 2, "Warm"), warm))
            if run["errors"]:
                raise SystemExit(f"{name}: the warm-up failed: {run['errors']}")
            wait_idle(chain)
        for rnd in range(args.rounds):
            order = [COLOCATED, SPLIT] if rnd % 2 == 0 else [SPLIT, COLOCATED]
            for level_index, streams in enumerate(levels):
                seed = 1000 * (rnd + 1) + 100 * level_index
                stream_prompts = prompts(4 * streams, stream_words, seed, "Stream")
                long_prompts = prompts(num_long, long_words, seed + 1, "Document")
                for name in order:
                    run_args = argparse.Namespace(**{**vars(args), "streams_now": streams})
                    metrics_url = chains[name].metrics_urls["scheduler"]
                    before = read_counters(metrics_url)
                    run = uvloop.run(run_mix(chains[name].url, args.model, stream_prompts, long_prompts, run_args))
                    wait_idle(chains[name])
                    after = read_counters(metrics_url)
                    # Every token the scheduler took in or sent over the run: prompts (the long ones
                    # most) and output, the cut streams' included.
                    run["all_tok_s"] = sum(after[k] - before[k] for k in TOKEN_SERIES) / run["seconds"]
                    if name == SPLIT:
                        run["transfer"] = transfer_figures(before, after, block_bytes)
                        transfers.append(run["transfer"])
                    run.update(round=rnd, chain=name, first=order[0])
                    (work / f"{name}-{streams}-{rnd}.json").write_text(json.dumps(run, indent=1))
                    results.setdefault((streams, name), []).append(run)
                    print(f"round {rnd}, {streams} streams, {name}: {run['tok_s']:.0f} tok/s, ITL p50/p90 "
                          f"{1000 * run['itl_s']['p50']:.0f}/{1000 * run['itl_s']['p90']:.0f} ms, long TTFT p50 "
                          f"{run['long_ttft_s']['p50']:.2f} s ({run['long_prompts']} long, "
                          f"{len(run['errors'])} errors)", file=sys.stderr, flush=True)
    finally:
        for chain in chains.values():
            chain.stop()
    rows = summary(results)
    print_table(rows)
    if any(t["blocks"] for t in transfers):
        print(transfer_line(transfers, block_bytes))
    (work / "summary.json").write_text(json.dumps({"args": vars(args), "rows": rows, "transfers": transfers,
                                                   "block_bytes": block_bytes}, indent=1))
    print(f"runs and logs in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
