"""bench.disaggregation's own logic: distinct prompts, the run of streams and
long prompts against a fake server, the transfer figures from counter deltas,
the block size from a worker's log, and the per-round ratios."""
from __future__ import annotations

import argparse
import asyncio
import json

from bench import disaggregation as dis

METRICS = """# HELP stormserve:kv_transfers_total Sequences moved
stormserve:kv_transfers_total{model_name="m",outcome="sent"} 3.0
stormserve:kv_transfers_total{model_name="m",outcome="recomputed"} 1.0
stormserve:kv_transfer_bytes_total{model_name="m"} 7372800.0
stormserve:kv_transfer_duration_seconds_sum{model_name="m"} 0.2
stormserve:kv_transfer_duration_seconds_count{model_name="m"} 3.0
stormserve:kv_transfer_duration_seconds_bucket{model_name="m",le="0.1"} 2.0
vllm:prompt_tokens_total{model_name="m",engine="0"} 400.0
vllm:prompt_tokens_total{model_name="m",engine="1"} 100.0
vllm:generation_tokens_total{model_name="m",engine="1"} 50.0
"""


def test_prompts_are_distinct_and_fixed_by_the_seed():
    first, again, other = dis.prompts(4, 50, 7, "Doc"), dis.prompts(4, 50, 7, "Doc"), dis.prompts(4, 50, 8, "Doc")
    assert first == again and len(set(first + other)) == 8
    assert len({p[:20] for p in first + other}) == 8  # each opens with its own tag and seed: no shared first block
    assert all(len(p.split(": ", 1)[1].split()) == 50 for p in first)


def test_counters_and_transfer_figures_per_block():
    before = dis.parse_counters("")
    after = dis.parse_counters(METRICS)
    assert after["vllm:prompt_tokens_total"] == 500 and after["outcome:sent"] == 3
    figures = dis.transfer_figures(before, after, block_bytes=368640)
    assert figures["blocks"] == 20 and figures["bytes_per_block"] == 368640
    assert abs(figures["ms_per_block"] - 10.0) < 1e-9 and abs(figures["ms_per_transfer"] - 200 / 3) < 1e-9
    assert figures["sent"] == 3 and figures["recomputed"] == 1
    assert dis.transfer_figures(before, before, 368640)["ms_per_block"] == 0.0
    line = dis.transfer_line([figures, dis.transfer_figures(before, before, 368640)], 368640)
    assert "medians of 1 runs): 10.00 ms per block of 368,640 bytes (37 MB/s), 67 ms per transfer of 7 blocks" in line
    assert line.endswith("outcomes: sent 3, retried 0, recomputed 1, kept 0")


def test_block_bytes_from_the_workers_log(tmp_path):
    (tmp_path / "worker0.log").write_text(
        "x INFO services.worker.kv_cache: KV cache: 2912 blocks x 16 tokens = 46592 tokens, 1023.8 MiB, "
        "23040 bytes per token (bfloat16, 30 layers, 3 kv heads, head_dim 64)\n")
    assert dis.block_bytes_of(tmp_path) == 16 * 23040


def run(streams: int, ttft: float, tok_s: float) -> dict:
    return {"itl_s": {"p50": 0.05, "p90": 0.1 * streams, "p99": 0.2 * streams}, "stream_ttft_s": {"p50": ttft},
            "long_ttft_s": {"p50": 2 * ttft, "p90": 3 * ttft}, "tok_s": tok_s, "all_tok_s": 2 * tok_s}


def test_summary_gives_medians_and_the_per_round_ratios_of_1p1d_to_colocated():
    results = {(16, dis.COLOCATED): [run(16, 1.0, 100), run(16, 1.0, 200), run(16, 1.0, 300)],
               (16, dis.SPLIT): [run(4, 2.0, 50), run(4, 2.0, 100), run(4, 2.0, 600)]}
    rows = {r["chain"]: r for r in dis.summary(results)}
    assert rows[dis.COLOCATED]["tok/s"] == 200 and "tok/s ratio" not in rows[dis.COLOCATED]
    assert rows[dis.SPLIT]["tok/s"] == 100 and rows[dis.SPLIT]["tok/s ratio"] == 0.5  # of 0.5, 0.5, 2.0
    assert rows[dis.SPLIT]["ITL p90"] == 400 and rows[dis.SPLIT]["ITL p90 ratio"] == 0.25
    assert rows[dis.SPLIT]["long TTFT p50 ratio"] == 2.0


def test_a_run_times_streams_and_long_prompts_and_cuts_the_streams():
    bodies = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        body = json.loads(await reader.readexactly(length))
        bodies.append(body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        try:
            for _ in range(body["max_tokens"]):
                writer.write(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.write(b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\ndata: [DONE]\n\n'
                         % body["max_tokens"])
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def scenario() -> dict:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            args = argparse.Namespace(streams_now=2, stream_output_len=1000, long_output_len=3, long_first_s=0.05,
                                      long_every_s=0.1, seconds=0.3)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            return await dis.run_mix(url, "m", ["s1", "s2"], ["long1", "long2"], args)

    result = asyncio.run(scenario())
    assert result["long_prompts"] == 2 and result["stream_requests"] == 2 and not result["errors"]
    assert len(result["long_ttfts_s"]) == 2 and 0.25 <= result["seconds"] < 5
    # The streams were cut (1000 tokens at 10 ms would take 10 s); their chunks so far count.
    assert 2 * 6 <= result["output_tokens"] - 2 * 3 < 2 * 1000
    assert result["itl_s"]["p50"] > 0.005
    assert {b["messages"][0]["content"] for b in bodies} == {"s1", "s2", "long1", "long2"}
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
