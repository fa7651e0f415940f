"""A chain whose one worker is a tensor-parallel group of two ranks (two gloo
processes on this CPU), as `STORMSERVE_TENSOR_PARALLEL_SIZE=2 make run` starts
it: the same greedy text as the one-process worker through the `openai`
client, and a follower rank killed mid-stream ends the stream with the
scheduler's worker-lost error, not a hang."""
from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from services.common.errors import WORKER_LOST
from tests.e2e.conftest import MODEL, running_chain
from tests.e2e.test_faults_e2e import assert_ended_by_an_error_frame, stream

PROMPTS = ["Name three colours of the rainbow.", "Write one sentence about the sea."]


@pytest.fixture(scope="module")
def tp_chain(tmp_path_factory):
    """float32, as the one-process chain it is compared with."""
    env = {"STORMSERVE_DTYPE": "float32", "STORMSERVE_TENSOR_PARALLEL_SIZE": "2",
           "STORMSERVE_KV_CACHE_MIB": "128"}
    with running_chain(tmp_path_factory.mktemp("tp-chain"), env=env) as (chain, _):
        yield chain


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _greedy(url: str, prompt: str) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=40, temperature=0)
    return reply.choices[0].message.content


def test_two_ranks_answer_with_one_ranks_greedy_text(tp_chain, chain):
    assert len(_children(tp_chain.procs["worker0"].pid)) == 1  # rank 0 runs beside its follower
    for prompt in PROMPTS:
        assert _greedy(tp_chain.url, prompt) == _greedy(chain.url, prompt)


def test_a_killed_follower_ends_the_stream_with_worker_lost(tp_chain):
    """Last in this module: the group is gone afterwards (no supervisor restarts it here)."""
    (follower,) = _children(tp_chain.procs["worker0"].pid)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        outcome = pool.submit(stream, tp_chain.url, 0, started)
        assert started.wait(300), "the stream never started"
        os.kill(follower, signal.SIGKILL)
        assert_ended_by_an_error_frame(tp_chain, [outcome.result(timeout=120)], {WORKER_LOST})
    assert tp_chain.procs["worker0"].wait(60) != 0  # rank 0 went with its group
