"""The API features on the real chain: stream_options.include_usage (default
chain), and on a second chain started with fullTextEnabled, API keys and a
2 s e2eTimeout: the cumulative stream, 401s, and a timed-out request that
ends with code 802 and leaves nothing running in the scheduler."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import MODEL, load_reader, running_chain
from tests.e2e.test_chat_e2e import QUESTION, parse_sse

# The default chain is shared with test_chat_e2e, which expects its prompts to
# miss the prefix cache: our own system prompt keeps even the first KV block apart.
ASK = [{"role": "system", "content": "Answer in one short sentence."}, *QUESTION]
KEYS = ("sk-e2e-one", "sk-e2e-two")
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
LONG = {"model": MODEL, "messages": ASK, "max_tokens": 500, "ignore_eos": True}


def stream_chunks(url: str, body: dict, headers: dict | None = None) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        raw = b"".join(response.iter_bytes())
    return [json.loads(p) for p in parse_sse(raw)]


# -- usage in streams (default chain) ---------------------------------------------


def test_include_usage_true_sends_usage_once_in_a_last_chunk_without_choices(base_url):
    chunks = stream_chunks(base_url, {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0,
                                      "stream_options": {"include_usage": True}})
    *text_chunks, last = chunks
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in text_chunks)
    assert text_chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["choices"] == [] and last["id"] == text_chunks[0]["id"]
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert len(usage["batch_size"]) == len(usage["queue_wait_time"]) == usage["completion_tokens"] > 0


def test_include_usage_false_sends_no_usage_and_absent_keeps_it_on_the_final_chunk(base_url):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0}
    off = stream_chunks(base_url, {**body, "stream_options": {"include_usage": False}})
    assert all("usage" not in c and len(c["choices"]) == 1 for c in off)
    default = stream_chunks(base_url, body)
    assert ["usage" in c for c in default] == [False] * (len(default) - 1) + [True]


def test_openai_client_with_include_usage(openai_client):
    stream = openai_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


# -- the configured chain -------------------------------------------------------------


@pytest.fixture(scope="module")
def configured_chain_and_stub(tmp_path_factory):
    env = {"STORMSERVE_REQUEST_TIMEOUT_S": "2", "STORMSERVE_FULL_TEXT_ENABLED": "true",
           "STORMSERVE_API_KEYS": ",".join(KEYS)}
    with running_chain(tmp_path_factory.mktemp("configured-chain-logs"), env=env) as (chain, stub):
        # Warm-up: the first forward pass is slow, and this chain gives each request 2 s.
        httpx.post(chain.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, "messages": QUESTION, "max_tokens": 2})
        yield chain, stub


@pytest.fixture(scope="module")
def configured(configured_chain_and_stub):
    return configured_chain_and_stub[0]


@pytest.fixture(scope="module")
def configured_load(configured_chain_and_stub):
    return load_reader(configured_chain_and_stub[1])


def wait_until_idle(load, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        now = load()
        if (now.num_running, now.num_waiting) == (0, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_api_keys_on_the_real_edge(configured):
    url = configured.url
    assert httpx.get(url + "/health").status_code == 200
    for headers, code in [({}, 702), ({"Authorization": "Bearer sk-e2e-three"}, 801)]:
        for reply in (httpx.get(url + "/v1/models", headers=headers),
                      httpx.post(url + "/v1/chat/completions", headers=headers,
                                 json={"model": MODEL, "messages": QUESTION, "max_tokens": 1})):
            assert reply.status_code == 401 and reply.json()["code"] == code
    models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert [m["id"] for m in models.json()["data"]] == [MODEL]


def test_full_text_enabled_streams_the_text_so_far(configured):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    chunks = stream_chunks(configured.url, body, AUTH)
    contents = [c["choices"][0]["delta"]["content"] for c in chunks]
    for shorter, longer in zip(contents, contents[1:]):
        assert longer.startswith(shorter)
    last = chunks[-1]
    assert list(last) == ["id", "object", "created", "model", "system_fingerprint", "full_text", "usage",
                          "choices"]
    assert last["full_text"] == contents[-1] != ""
    assert all("full_text" not in c for c in chunks[:-1])
    # Non-stream replies are unaffected: the same greedy text, no full_text.
    reply = httpx.post(configured.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == last["full_text"] and "full_text" not in reply


def test_stream_past_e2e_timeout_ends_with_802_and_frees_the_sequence(configured, configured_load):
    started = time.monotonic()
    with httpx.stream("POST", configured.url + "/v1/chat/completions", json={**LONG, "stream": True},
                      headers=AUTH, timeout=60) as response:
        pieces = response.iter_bytes()
        raw = next(pieces)
        busy = configured_load()
        assert busy.num_running + busy.num_waiting == 1  # the sequence was there to be freed
        raw += b"".join(pieces)
    assert 1.9 < time.monotonic() - started < 10
    *text_chunks, error = [json.loads(p) for p in parse_sse(raw)]
    assert text_chunks and all(c["object"] == "chat.completion.chunk" for c in text_chunks)
    assert error["code"] == 802 and error["result"] is None and error["finish_reason"] == "stop"
    assert error["error"] == error["message"] and "e2eTimeout" in error["message"]
    assert (wait_until_idle(configured_load).num_running, configured_load().num_waiting) == (0, 0)


def test_non_stream_past_e2e_timeout_is_500_802_and_frees_the_sequence(configured, configured_load):
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, configured.url + "/v1/chat/completions", json=LONG, headers=AUTH,
                              timeout=60)
        time.sleep(1.0)
        busy = configured_load()
        assert busy.num_running + busy.num_waiting == 1  # the sequence was there to be freed
        reply = pending.result()
    assert reply.status_code == 500
    assert reply.json()["code"] == 802 and reply.json()["error_type"] == "Incomplete Generation"
    idle = wait_until_idle(configured_load)
    assert (idle.num_running, idle.num_waiting) == (0, 0)
    # The chain still serves afterwards.
    assert httpx.get(configured.url + "/health").status_code == 200
