"""The benchmark's own logic: a fixed dataset, honest percentiles, a plot, and its
HTTP client reading server-sent events however a server frames them."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from transformers import AutoTokenizer

from bench.grounded import make_grounded_prompts
from bench.serve import (
    FOLLOW_UPS,
    PREFIX_CACHE_COUNTERS,
    SCHEDULER_COUNTERS,
    HTTPStatusError,
    level_prompts,
    make_prompts,
    percentiles,
    plot,
    post_events,
    prefix_cache_figures,
    run_level,
    speculation_figures,
)
from services.common.model_files import default_model_path, resolve_model


def test_dataset_is_fixed_by_the_seed():
    assert make_prompts(4, 200, seed=1) == make_prompts(4, 200, seed=1)
    assert make_prompts(4, 200, seed=1) != make_prompts(4, 200, seed=2)
    assert len(set(make_prompts(8, 50, seed=0))) == 8


def test_percentiles():
    values = [float(v) for v in range(1, 101)]
    stats = percentiles(values)
    assert stats["p50"] == 50.5 and stats["p90"] == 91.0 and stats["p99"] == 100.0
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_plot_writes_a_png(tmp_path):
    level = lambda c, tps: {"concurrency": c, "output_tok_per_s": tps,  # noqa: E731
                            "ttft_s": {"p50": 0.1 * c, "p90": 0.2 * c}, "itl_s": {"p50": 0.05, "p90": 0.08}}
    path = tmp_path / "plot.png"
    plot({"us": [level(1, 10), level(8, 60)], "peer": [level(1, 50), level(8, 45)]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_levels_share_no_prompt():
    warm_ups, measured = zip(*(level_prompts(8, 100, seed=0, level=i) for i in range(3)))
    everything = list(warm_ups) + [p for prompts in measured for p in prompts]
    assert all(len(prompts) == 8 for prompts in measured)
    assert len(set(everything)) == len(everything)
    assert level_prompts(8, 100, seed=0, level=1) == level_prompts(8, 100, seed=0, level=1)


EVENTS = [b'{"choices": [{"delta": {"content": "Hel"}}]}', b'{"choices": [{"delta": {"content": "lo"}}]}', b"[DONE]"]


async def _serve_once(response: bytes) -> tuple[asyncio.AbstractServer, int, list[bytes]]:
    """A server that answers one request with `response`, written in 7-byte pieces."""
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        requests.append(head + await reader.readexactly(length))
        for i in range(0, len(response), 7):
            writer.write(response[i : i + 7])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], requests


def _chunked(body: bytes, piece: int) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece])
                    for i in range(0, len(body), piece)) + b"0\r\n\r\n"


async def _collect(response: bytes) -> tuple[list[bytes], list[bytes]]:
    server, port, requests = await _serve_once(response)
    async with server:
        events = [e async for e in post_events(f"http://127.0.0.1:{port}/v1/chat/completions", b'{"a": 1}')]
    return events, requests


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("chunked", [True, False])
def test_client_reads_every_event_however_framed(separator, chunked):
    body = b"".join(b"data: " + e + separator for e in EVENTS)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    # Chunks of 11 bytes cut lines and events anywhere; without chunking the body runs to the close.
    response = head + (b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(body, 11) if chunked else b"\r\n" + body)
    events, requests = asyncio.run(_collect(response))
    assert events == EVENTS
    assert requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert requests[0].endswith(b'\r\n\r\n{"a": 1}')


def test_client_reports_a_refusal_with_its_body():
    body = b'{"error": "bad temperature"}'
    response = b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    with pytest.raises(HTTPStatusError, match="HTTP 422.*bad temperature"):
        asyncio.run(_collect(response))


def test_grounded_prompts_are_fixed_by_the_seed_and_have_the_tokens_asked_for():
    assert make_grounded_prompts(6, 200, seed=1) == make_grounded_prompts(6, 200, seed=1)
    assert make_grounded_prompts(6, 200, seed=1) != make_grounded_prompts(6, 200, seed=2)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    prompts = make_grounded_prompts(16, 300, seed=3)
    assert {prompt.split()[0] for prompt in prompts} == {"Repeat", "Rename", "Copy", "Convert"}
    for prompt in prompts:  # each kind splits its words into tokens at its own rate
        assert 270 <= len(tokenizer(prompt)["input_ids"]) <= 340, prompt[:40]
    warm_up, measured = level_prompts(4, 100, seed=0, level=0, workload="grounded")
    assert warm_up not in measured and len(set(measured)) == 4


def test_speculation_figures_from_counter_deltas():
    before = dict.fromkeys(SCHEDULER_COUNTERS, 10.0)
    after = dict(zip(SCHEDULER_COUNTERS, (20.0, 50.0, 40.0, 110.0, 60.0)))
    figures = speculation_figures(before, after)
    assert figures["acceptance_rate"] == 30 / 40
    assert figures["tokens_per_draft"] == 1 + 30 / 10
    assert figures["tokens_per_step"] == 100 / 50


def test_turns_send_the_conversation_so_far():
    """--turns: each next turn sends the last one's messages, its answer and a follow-up."""
    answer = b'data: {"choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\ndata: [DONE]\n\n'
    bodies: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + answer)
        await writer.drain()
        writer.close()

    async def scenario() -> dict:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with server:
            args = argparse.Namespace(base_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                                      model="m", output_len=4, ignore_eos=False, timeout=30, seed=0, turns=3,
                                      metrics_url="")
            return await run_level(args, "warm", ["first"], concurrency=1, rate=None)

    level = asyncio.run(scenario())
    assert level["requests"] == 3 and level["num_errors"] == 0 and level["turns"] == 3
    turns = [b["messages"] for b in bodies[1:]]  # after the warm-up
    assert turns[0] == [{"role": "user", "content": "first"}]
    assert turns[1] == [*turns[0], {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": FOLLOW_UPS[0]}]
    assert turns[2][:len(turns[1])] == turns[1] and turns[2][-1] == {"role": "user", "content": FOLLOW_UPS[1]}


def test_prefix_cache_figures_from_counter_deltas():
    before = dict.fromkeys(PREFIX_CACHE_COUNTERS, 100.0)
    after = dict(zip(PREFIX_CACHE_COUNTERS, (500.0, 300.0)))
    assert prefix_cache_figures(before, after) == {"queried_tokens": 400, "hit_tokens": 200, "hit_rate": 0.5}
    assert prefix_cache_figures(before, before)["hit_rate"] == 0.0
