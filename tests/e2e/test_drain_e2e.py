"""Graceful drain through the real chain (two workers, the bundled model):
SIGTERM to an edge while streams run, with a drain timeout long enough for
them and one too short; SIGTERM to a worker while streams run on both.
Each test prints what it measured (streams in flight, SIGTERM to exit)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.supervisor import free_port
from tests.e2e.conftest import MODEL, load_reader, running_chain

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [{"role": "user", "content": "Count from one to one thousand in words, one number per line."}]


def stream_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": PROMPT, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def drain_chain(tmp_path_factory):
    # A loaded 2-core machine can take more than the default 5 s to start a render process,
    # and more than the default 30 s drain for a worker's streams (the edges set their own).
    env = {"STORMSERVE_TEMPLATE_TIMEOUT_S": "60", "STORMSERVE_DRAIN_TIMEOUT_S": "300"}
    with running_chain(tmp_path_factory.mktemp("drain"), num_workers=2, env=env) as (chain, stub):
        yield chain, load_reader(stub)


class Stream:
    """One streaming request read in the background: its frames, and when the first came."""

    def __init__(self, client: httpx.AsyncClient, max_tokens: int):
        self.frames: list[Any] = []
        self.status: int | None = None
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._read(client, max_tokens))

    async def _read(self, client: httpx.AsyncClient, max_tokens: int) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=stream_body(max_tokens)) as reply:
            self.status = reply.status_code
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    self.frames.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.started.set()
        self.started.set()

    @property
    def num_tokens(self) -> int:
        return sum(1 for f in self.frames if isinstance(f, dict) and f.get("choices")
                   and f["choices"][0]["delta"].get("content"))

    def assert_complete(self, max_tokens: int) -> None:
        """Every token, a finish_reason, [DONE], and no error frame."""
        assert self.status == 200 and self.frames[-1] == "[DONE]", self.frames[-3:]
        assert not any("error" in f for f in self.frames[:-1]), [f for f in self.frames if "error" in f]
        finishes = [f["choices"][0]["finish_reason"] for f in self.frames[:-1] if f.get("choices")]
        assert finishes[-1] == "length"
        assert self.frames[-2]["usage"]["completion_tokens"] == max_tokens


async def start_streams(client: httpx.AsyncClient, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(client, max_tokens) for _ in range(count)]
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 300)
    return streams


def start_edge(tokenizer_port: int, drain_timeout_s: float, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A `python -m services.http_edge` of its own in front of the chain's tokenizer."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "gen"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.http_edge", "--port", str(port),
         "--tokenizer-address", f"127.0.0.1:{tokenizer_port}", "--drain-timeout-s", str(drain_timeout_s)],
        cwd=ROOT, env=env, stdout=log_path.open("ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the edge did not become healthy")


async def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"still running {timeout_s} s after SIGTERM"
        await asyncio.sleep(0.05)
    return proc.returncode


def assert_refused_503(reply: httpx.Response) -> None:
    assert reply.status_code == 503
    body = reply.json()
    assert set(body) == {"error", "error_type", "code", "result", "message"}
    assert body["error_type"] == "Service Unavailable" and body["code"] == 503 and body["result"] is None
    assert "shutting down" in body["message"]


def test_sigterm_to_the_edge_lets_its_streams_finish_and_refuses_new_requests(drain_chain, tmp_path):
    chain, _ = drain_chain
    num_streams, max_tokens, drain_timeout_s = 8, 160, 120
    proc, url = start_edge(chain.tokenizer_port, drain_timeout_s, tmp_path / "edge.log")

    async def scenario() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            streams = await start_streams(client, num_streams, max_tokens)
            in_flight = [s.num_tokens for s in streams]
            sigterm_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=url, timeout=10) as late:
                assert_refused_503(await late.get("/health"))
                assert_refused_503(await late.post("/v1/chat/completions", json=stream_body(8)))
            assert proc.poll() is None and not any(s.task.done() for s in streams), in_flight
            await asyncio.gather(*(s.task for s in streams))
            last_stream_at = time.monotonic()
            for stream in streams:
                stream.assert_complete(max_tokens)
            assert await wait_exit(proc, drain_timeout_s) == 0
            return last_stream_at - sigterm_at, time.monotonic() - sigterm_at

    try:
        streams_s, exit_s = asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"\nedge drain: {num_streams} streams of {max_tokens} tokens in flight; SIGTERM -> last stream "
          f"done {streams_s:.2f} s, -> exit 0 {exit_s:.2f} s (drain timeout {drain_timeout_s} s)")
    assert exit_s - streams_s < 2.5


def test_streams_still_running_at_the_edge_drain_timeout_end_with_an_error_frame(drain_chain, tmp_path):
    chain, load = drain_chain
    num_streams, max_tokens, drain_timeout_s = 4, 400, 1.5
    proc, url = start_edge(chain.tokenizer_port, drain_timeout_s, tmp_path / "edge.log")

    async def scenario() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            streams = await start_streams(client, num_streams, max_tokens)
            sigterm_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*(s.task for s in streams))
            assert await wait_exit(proc, drain_timeout_s + 5) == 0
            exit_s = time.monotonic() - sigterm_at
        for stream in streams:
            assert stream.frames[-1] == "[DONE]"
            error = stream.frames[-2]
            assert error["code"] == 503 and error["error_type"] == "Service Unavailable"
            assert f"drain timeout ({drain_timeout_s:g} s) passed" in error["message"]
            assert error["finish_reason"] and 0 < stream.num_tokens < max_tokens
        return exit_s

    try:
        exit_s = asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"\nedge drain timeout: {num_streams} streams of {max_tokens} tokens in flight; SIGTERM -> exit 0 "
          f"{exit_s:.2f} s (drain timeout {drain_timeout_s} s); each ended with an error frame and [DONE]")
    assert drain_timeout_s <= exit_s < drain_timeout_s + 3
    # The cut streams' sequences were cancelled all the way back.
    deadline = time.monotonic() + 30
    while sum(w.num_running + w.num_waiting for w in load().workers) > 0:
        assert time.monotonic() < deadline, "the scheduler still runs the cut streams"
        time.sleep(0.2)


def test_sigterm_to_a_worker_drains_it_while_the_other_takes_new_requests(drain_chain):
    """Last in the module: worker0 does not come back."""
    chain, load = drain_chain
    worker = chain.procs["worker0"]
    num_streams, max_tokens = 8, 256

    # Seconds from SIGTERM until the scheduler saw worker0 draining, it had nothing left, and it exited.
    marks: dict[str, float] = {}

    async def watch(sigterm_at: float) -> None:
        while worker.poll() is None:
            own = load().workers[0]
            if "idle" not in marks and own.num_running + own.num_waiting == 0:
                marks["idle"] = time.monotonic() - sigterm_at
            await asyncio.sleep(0.1)
        marks["exit"] = time.monotonic() - sigterm_at

    async def scenario() -> tuple[int, float]:
        async with httpx.AsyncClient(base_url=chain.url, timeout=300) as client:
            streams = await start_streams(client, num_streams, max_tokens)
            before = load().workers
            assert before[0].num_running > 0 and before[1].num_running > 0, before
            on_worker0 = before[0].num_running + before[0].num_waiting
            sigterm_at = time.monotonic()
            worker.send_signal(signal.SIGTERM)
            watcher = asyncio.create_task(watch(sigterm_at))
            deadline = time.monotonic() + 10
            while load().workers[0].is_ready:  # the scheduler sees it draining within a health poll
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            marks["draining"] = time.monotonic() - sigterm_at
            assert worker.poll() is None, "worker0 left before its streams were done"
            placed = [w.num_sequences for w in load().workers]
            late = await start_streams(client, 4, 16)
            after = [w.num_sequences for w in load().workers]
            assert after[0] == placed[0] and after[1] == placed[1] + 4, (placed, after)
            await asyncio.gather(*(s.task for s in streams + late))
            last_stream_at = time.monotonic()
            for stream in streams:
                stream.assert_complete(max_tokens)
            for stream in late:
                stream.assert_complete(16)
            assert await wait_exit(worker, 300) == 0
            await watcher
            return on_worker0, last_stream_at - sigterm_at

    on_worker0, streams_s = asyncio.run(scenario())
    print(f"\nworker drain: {on_worker0} of {num_streams} streams on the draining worker; SIGTERM -> seen draining "
          f"{marks['draining']:.2f} s, -> its last sequence done {marks['idle']:.2f} s, -> worker exit 0 "
          f"{marks['exit']:.2f} s; all {num_streams} + 4 streams done {streams_s:.2f} s")
    assert marks["exit"] - marks["idle"] < 10  # the settle (2 s), the release step, the process's own exit
    assert load().num_workers_ready == 1
