"""Faults on the real chain, healed by the supervisor's own loop (Chain.supervise,
which `make run` runs): the scheduler or the worker killed with SIGKILL under load
ends the streams in flight with a final error frame that names no address, a
request while the scheduler is down gets a 503 that names none either, and the
chain serves again without anything restarted by hand."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from services.common.errors import NO_WORKER_READY, WORKER_LOST
from tests.e2e.conftest import MODEL, load_reader, running_chain
from tests.e2e.test_chat_e2e import parse_sse

STREAMS = 3
RETRY = "the service is temporarily unavailable, retry"
# What a client reads while a service is down: the scheduler's own words for a
# lost or missing worker; the fixed message where the gRPC library failed.
DOWN_MESSAGES = {"scheduler": {RETRY}, "worker0": {WORKER_LOST, NO_WORKER_READY}}
HEAL_LIMIT_S = 300


@pytest.fixture(scope="module")
def chain_and_load(tmp_path_factory):
    """float32 as the other e2e chains; 128 MiB of KV (about 180 blocks of 16
    tokens) holds the streams of a test at once."""
    env = {"STORMSERVE_DTYPE": "float32", "STORMSERVE_KV_CACHE_MIB": "128"}
    with running_chain(tmp_path_factory.mktemp("faults"), env=env) as (chain, stub):
        supervising = threading.Thread(target=chain.supervise, kwargs={"poll_s": 0.2}, daemon=True)
        supervising.start()
        yield chain, load_reader(stub)
    supervising.join(30)  # the chain's stop() ended it


def assert_nothing_internal(chain, text: str) -> None:
    """No address, port, service or transport detail, no exception text."""
    ports = [chain.edge_port, chain.tokenizer_port, chain.scheduler_port, *chain.worker_ports]
    for secret in ["127.0.0.1", "localhost", "ipv4", "ipv6", "Socket closed", "Connection", "connect",
                   "StatusCode", "Traceback", "Exception", "Error:", "worker0", *(f":{p}" for p in ports)]:
        assert secret not in text, (secret, text)


def stream(url: str, number: int, started: threading.Event) -> tuple[int, bytes]:
    """A long greedy stream; `started` is set once its first chunk came."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell a long story, number {number}."}],
            "stream": True, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        raw = b""
        for piece in response.iter_bytes():
            raw += piece
            started.set()
        return response.status_code, raw


def ask(url: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 plus 2?"}],
            "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=300)


def kill_under_load(chain, service: str, while_down) -> tuple[float, list[tuple[int, bytes]]]:
    """Kills `service` with SIGKILL while STREAMS streams are mid-way and calls
    `while_down` right after; returns when it was killed and the streams'
    statuses and bodies."""
    started = [threading.Event() for _ in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, chain.url, i, started[i]) for i in range(STREAMS)]
        for event in started:
            assert event.wait(300), "a stream never started"
        os.kill(chain.procs[service].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while_down()
        return killed_at, [f.result(timeout=300) for f in futures]


def assert_ended_by_an_error_frame(chain, outcomes: list[tuple[int, bytes]], messages: set[str]) -> None:
    for status, raw in outcomes:
        assert status == 200, raw
        *chunks, last = [json.loads(p) for p in parse_sse(raw)]
        assert chunks and all("error" not in c for c in chunks)
        assert last["error"] == last["message"] and last["message"] in messages and last["code"] == 9999, last
        assert last["result"] is None and last["finish_reason"]
        assert_nothing_internal(chain, json.dumps(last))  # the rest is the model's text


def wait_until_served(chain, get_load, service: str, since: float, restarts: dict[str, int]) -> str:
    """Waits until the chain serves again: the supervisor restarted `service`
    once more than `restarts` says, the scheduler has a ready worker, /health
    answers 200. From then on every request must succeed (a restarted
    scheduler's sequences must not trip over what the worker kept of the old
    one's). Returns how long each stage took from `since`."""
    stages = []

    def poll(ready, stage: str) -> None:
        while not ready():
            assert time.monotonic() - since < HEAL_LIMIT_S, f"the chain did not serve again: no {stage}"
            time.sleep(0.2)
        stages.append(f"{stage} {time.monotonic() - since:.1f} s")

    def worker_ready() -> bool:
        try:
            return get_load().num_workers_ready == 1
        except grpc.RpcError:  # the scheduler is not back yet
            return False

    poll(lambda: chain.restarts.get(service, 0) > restarts.get(service, 0), "restart")
    poll(worker_ready, "worker ready")
    poll(lambda: httpx.get(chain.url + "/health", timeout=10).status_code == 200, "/health 200")
    first = ask(chain.url)
    assert first.status_code == 200, first.text
    stages.append(f"first reply {time.monotonic() - since:.1f} s")
    with ThreadPoolExecutor(STREAMS + 1) as pool:
        replies = list(pool.map(lambda _: ask(chain.url, max_tokens=16), range(STREAMS + 1)))
    assert [r.status_code for r in replies] == [200] * len(replies), [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] > 0 for r in replies)
    assert chain.restarts == {**restarts, service: restarts.get(service, 0) + 1}  # nothing else was
    return ", ".join(stages)


def assert_unavailable(chain, reply: httpx.Response, messages: set[str]) -> None:
    assert reply.status_code == 503, reply.text
    assert reply.json()["message"] in messages and reply.json()["code"] == 503, reply.text
    assert_nothing_internal(chain, reply.text)


# The scheduler first: the streams it loses hold its first sequence ids, which
# the restarted scheduler hands out again.
@pytest.mark.parametrize("service", ["scheduler", "worker0"])
def test_a_killed_service_is_restarted_and_the_chain_serves_again(chain_and_load, service):
    chain, get_load = chain_and_load
    restarts, down = dict(chain.restarts), []
    killed_at, outcomes = kill_under_load(chain, service, lambda: down.append(ask(chain.url)))
    assert_unavailable(chain, down[0], DOWN_MESSAGES[service])
    assert_ended_by_an_error_frame(chain, outcomes, DOWN_MESSAGES[service])
    print(f"{service} killed, then:", wait_until_served(chain, get_load, service, killed_at, restarts))
