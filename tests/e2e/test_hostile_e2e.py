"""Hostile clients against the real chain: request-supplied chat templates
(refused by default; on a server that trusts them, runaway templates queued
in their lane do not hold up an ordinary request), reserved template kwargs, and streaming
clients that stop reading (an ordinary request is served beside them; then
they are cancelled, their sequences and KV freed, while they still hold their
connections)."""
from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import suppress

import httpx
import pytest

from tests.e2e.conftest import MODEL, load_reader, running_chain

RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
ASK = [{"role": "user", "content": "Say hello."}]


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body}, timeout=timeout)


def wait_until_idle(load, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        worker = load().workers[0]
        if (worker.num_running, worker.num_waiting) == (0, 0) or time.monotonic() > deadline:
            return worker
        time.sleep(0.2)


# -- the default chain --------------------------------------------------------------


def test_a_request_template_is_refused_by_default(base_url):
    reply = post(base_url, {"max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 'hello ' * 2000000 }}"}})
    assert reply.status_code == 422
    assert "request-supplied chat templates are disabled" in reply.json()["message"]


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "tools", "continue_final_message"])
def test_reserved_template_kwargs_are_422_naming_the_key(base_url, key):
    reply = post(base_url, {"max_tokens": 2, "chat_template_kwargs": {key: True}})
    assert reply.status_code == 422 and reply.json()["code"] == 422
    assert f"chat_template_kwargs: {key} is reserved" in reply.json()["message"]


# -- a chain that trusts request templates and gives up on stalled readers ----------------


STALLED_CLIENTS, STALLED_N = 4, 16
STALLED_SEQUENCES = STALLED_CLIENTS * STALLED_N


@pytest.fixture(scope="module")
def hostile_chain_and_stub(tmp_path_factory):
    # A batch with room for one more than the stalled sequences, and readers given up on only
    # after a 1 MiB backlog or 5 s: an ordinary request has time to be served beside them.
    # Renders get 8 s: a runaway spinning on one of two cores slows the worker's decode
    # several-fold, and the ordinary request must still finish before the first runaway's 422.
    env = {"STORMSERVE_TRUST_REQUEST_CHAT_TEMPLATE": "true", "STORMSERVE_TEMPLATE_TIMEOUT_S": "8",
           "STORMSERVE_STREAM_STALL_TIMEOUT_S": "5", "STORMSERVE_STREAM_BUFFER_KIB": "1024",
           "STORMSERVE_MAX_BATCH_SIZE": str(STALLED_SEQUENCES + 8)}
    with running_chain(tmp_path_factory.mktemp("hostile-chain-logs"), env=env) as running:
        post(running[0].url, {"max_tokens": 2})  # warm-up
        yield running


@pytest.fixture(scope="module")
def hostile(hostile_chain_and_stub):
    return hostile_chain_and_stub[0]


RUNAWAYS = 3  # one rendering, two queued behind it


def test_runaway_templates_do_not_hold_up_an_ordinary_request(hostile):
    finished: list[tuple[str, int]] = []

    def send(name: str, body: dict) -> None:
        reply = post(hostile.url, {"max_tokens": 8, **body})
        finished.append((name, reply.status_code))

    runaways = [threading.Thread(target=send, args=(f"runaway{i}", {"chat_template_kwargs": {"chat_template": RUNAWAY}}))
                for i in range(RUNAWAYS)]
    for thread in runaways:
        thread.start()
    time.sleep(0.5)  # the runaways are rendering, or queued for their lane
    send("normal", {"temperature": 0})
    for thread in runaways:
        thread.join()
    # Ordering, not wall time: the ordinary request was answered before the
    # first runaway render reached its 8 s budget.
    assert finished[0] == ("normal", 200)
    assert sorted(finished[1:]) == [(f"runaway{i}", 422) for i in range(RUNAWAYS)]
    assert httpx.get(hostile.url + "/health").status_code == 200


def stalled_stream(url: str) -> socket.socket:
    """A streaming n=STALLED_N request (20 top logprobs a token) from a client that never reads its reply."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "messages": ASK, "stream": True, "n": STALLED_N, "temperature": 1.0,
                       "max_tokens": 500, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20}).encode()  # large chunks fill the socket soon
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """What the client had been sent, up to the edge's close or reset."""
    sock.settimeout(30)
    data = b""
    with suppress(ConnectionResetError):
        while piece := sock.recv(65536):
            data += piece
    return data


def test_clients_that_stop_reading_are_cancelled_and_free_their_sequences(hostile_chain_and_stub):
    chain, stub = hostile_chain_and_stub
    load = load_reader(stub)
    sockets = [stalled_stream(chain.url) for _ in range(STALLED_CLIENTS)]
    try:
        deadline = time.monotonic() + 60
        while load().workers[0].num_running < STALLED_SEQUENCES:  # they are all generating
            assert time.monotonic() < deadline, "the stalled requests never all ran"
            time.sleep(0.1)
        # An ordinary request is served beside them and answered while every
        # stalled sequence is still in the batch: they cost it nothing but
        # their own slots (ordering, not wall time).
        assert post(chain.url, {"max_tokens": 4, "temperature": 0}).status_code == 200
        assert load().workers[0].num_running >= STALLED_SEQUENCES
        # The clients still hold their connections and read nothing, yet every
        # sequence ends and gives its KV blocks back.
        idle = wait_until_idle(load)
        assert (idle.num_running, idle.num_waiting) == (0, 0)
        assert idle.num_free_kv_blocks == idle.num_kv_blocks
        for sock in sockets:
            reply = read_to_end(sock)  # the edge reset the connection
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            # Cut, not finished: reset without [DONE] (stalled past the stall timeout), or
            # ended by an error frame (fell more than the buffer behind, and that frame fitted).
            assert b"data: [DONE]" not in reply or b'"code":503' in reply, reply[-500:]
    finally:
        for sock in sockets:
            sock.close()
    assert post(chain.url, {"max_tokens": 4}).status_code == 200
