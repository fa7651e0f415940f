"""Two serving groups on loopback through the real chain (Chain with a second
scheduler, each with its own worker): the tokenizer spreads new conversations
over both, keeps a conversation's next turn on its group, and a group killed
under load fails only the requests it had in flight; new ones go to the other."""
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

from services.common.supervisor import Chain, free_port
from tests.e2e.conftest import MODEL, load_reader, scrape, total
from tests.e2e.test_chat_e2e import parse_sse
from tests.e2e.test_faults_e2e import RETRY, assert_nothing_internal
from stormserve.scheduler.v1 import scheduler_pb2_grpc

# Distinct openings of a few blocks each: a conversation's own prefix, not only the template's.
TOPICS = ["the history of the lighthouse keepers on the northern coast and their long winter nights",
          "how bees decide where to build a new hive when the old colony splits in spring",
          "the way old clockmakers cut the teeth of brass gears by hand before machines",
          "why rivers meander across flat plains and leave oxbow lakes behind over centuries"]

STORIES = ["a lantern maker who lost her last candle in a storm at sea and found her way home",
           "two mountain goats arguing about the shortest path to the summit in deep snow"]


@pytest.fixture(scope="module")
def two_groups(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("groups")
    env = {"STORMSERVE_KV_CACHE_MIB": "128", "STORMSERVE_NUM_THREADS": "1"}
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  group_scheduler_ports=[free_port()], worker_ports=[free_port(), free_port()],
                  env=env, log_dir=log_dir)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in chain.scheduler_ports]
    try:
        chain.start()
        chain.wait_ready(timeout_s=600)
        deadline = time.monotonic() + 600
        for chan in channels:  # /health is up with one group serving: wait for both
            load = load_reader(scheduler_pb2_grpc.SchedulerServiceStub(chan))
            while load().num_workers_ready < 1:
                assert time.monotonic() < deadline, "a group's worker did not become ready"
                time.sleep(0.5)
        yield chain
    finally:
        chain.stop()
        for chan in channels:
            chan.close()
        print(f"groups logs: {log_dir}")


def served(chain) -> list[float]:
    """Requests each group's scheduler has finished, in group order."""
    return [total(scrape(chain.metrics_urls[name])[1], "vllm:request_success_total")
            for name in chain.scheduler_names]


def test_each_groups_processes_label_their_metrics_with_its_index(two_groups):
    chain = two_groups
    expected = {**{name: str(g) for g, name in enumerate(chain.scheduler_names)},
                **{f"worker{i}": str(g) for g in range(len(chain.scheduler_names)) for i in chain.group_workers(g)}}
    for name, group in expected.items():
        assert {dict(labels).get("group") for _, labels in scrape(chain.metrics_urls[name])[1]} == {group}, name


def chat(chain, messages, max_tokens: int = 6) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(chain.url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_both_groups_serve_and_a_next_turn_stays_on_its_group(two_groups):
    chain = two_groups
    before = served(chain)
    conversations, groups = [], []
    for topic in TOPICS:
        messages = [{"role": "user", "content": f"Tell me about {topic}."}]
        messages.append({"role": "assistant", "content": chat(chain, messages)})
        after = served(chain)
        groups.append([a - b for a, b in zip(after, before)].index(1))
        before = after
        conversations.append(messages)
    assert set(groups) == {0, 1}, groups
    for messages, group in zip(conversations, groups):
        chat(chain, [*messages, {"role": "user", "content": "And then?"}])
        after = served(chain)
        assert [a - b for a, b in zip(after, before)] == [int(g == group) for g in (0, 1)]
        before = after


def stream(url: str, topic: str, started: threading.Event) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell a long story about {topic}."}],
            "stream": True, "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        raw = b""
        for piece in response.iter_bytes():
            raw += piece
            started.set()
        return raw


def test_a_killed_group_fails_only_its_in_flight_requests(two_groups):
    chain = two_groups
    started = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as pool:
        # New conversations (no prefix in common past the template): one on each group, the least loaded.
        futures = [pool.submit(stream, chain.url, topic, started[i]) for i, topic in enumerate(STORIES)]
        for event in started:
            assert event.wait(300), "a stream never started"
        os.kill(chain.procs["scheduler1"].pid, signal.SIGKILL)  # nothing restarts it here
        outcomes = [[json.loads(p) for p in parse_sse(f.result(timeout=300))] for f in futures]
    failed = [chunks for chunks in outcomes if "error" in chunks[-1]]
    finished = [chunks for chunks in outcomes if "error" not in chunks[-1]]
    assert len(failed) == 1 and len(finished) == 1, outcomes
    last = failed[0][-1]
    assert last["message"] == RETRY and last["code"] == 9999 and last["finish_reason"], last
    assert_nothing_internal(chain, json.dumps(last))
    assert finished[0][-1]["choices"][0]["finish_reason"] == "length"
    # New requests, new conversations and the next turns of old ones, go to the group left.
    for topic in TOPICS:
        chat(chain, [{"role": "user", "content": f"Tell me about {topic}."}], max_tokens=2)
    assert httpx.get(chain.url + "/health", timeout=10).status_code == 200
