"""Prometheus metrics through the real chain: scrape every /metrics after known
traffic and check the counters against the replies' `usage`, the histogram
counts and vLLM's bucket boundaries, and the gauges after a storm of clients
that leave mid-stream."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.common.metrics import (
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from tests.e2e.conftest import MODEL, scrape, total

VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:request_time_per_output_token_seconds": TOKEN_LATENCY_BUCKETS,
    "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_prompt_tokens": build_1_2_5_buckets(2560),
    "vllm:request_generation_tokens": build_1_2_5_buckets(2560),
    "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
}


@pytest.fixture(scope="module")
def urls(chain):
    return chain.metrics_urls


def scheduler_samples(urls):
    return scrape(urls["scheduler"])[1]


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_every_process_serves_metrics_and_no_pid_label(urls):
    assert set(urls) >= {"http_edge", "tokenizer", "scheduler", "worker0"}
    for name, url in urls.items():
        types, samples = scrape(url)
        assert "process_cpu_seconds" in types, name
        assert not any("pid" in dict(labels) for _, labels in samples), name
    types, samples = scrape(urls["scheduler"])
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:prompt_tokens"] == "counter"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    series = [dict(labels) for name, labels in samples if name == "vllm:num_requests_running"]
    assert series == [{"model_name": MODEL, "engine": "0", "group": "0"}]  # one serving group: "0"
    # A group's scheduler and workers label every series with it; the front carries none.
    for name, url in urls.items():
        groups = {dict(labels).get("group") for _, labels in scrape(url)[1]}
        assert groups == ({"0"} if name.startswith(("scheduler", "worker")) else {None}), name
    info = [dict(labels) for name, labels in samples if name == "vllm:cache_config_info"]
    assert info and {"block_size", "num_gpu_blocks", "engine"} <= set(info[0])
    # The engine set only on the scheduler: a sum over pods counts each token once.
    assert not any(name.startswith("vllm:") for name, _ in scrape(urls["http_edge"])[1])


def test_counters_move_by_exactly_the_reported_usage(urls, openai_client):
    before = scheduler_samples(urls)
    edge_before = scrape(urls["http_edge"])[1]
    question = [{"role": "user", "content": "Name one planet of the solar system."}]
    replies = [openai_client.chat.completions.create(model=MODEL, messages=question, temperature=0,
                                                     max_tokens=max_tokens)
               for max_tokens in (1, 5, 24, 24, 64)]  # the same prompt again: prefix-cache hits
    stream = openai_client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    usages = [r.usage for r in replies] + [chunks[-1].usage]
    reasons = [r.choices[0].finish_reason for r in replies]
    reasons += [next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)]
    count = len(usages)
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    # A Generate call's last bookkeeping may follow its last message by a moment.
    after = wait_for(lambda: (s := scheduler_samples(urls)) and
                     total(s, "vllm:e2e_request_latency_seconds_count")
                     - total(before, "vllm:e2e_request_latency_seconds_count") >= count and s)
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    for reason in ("stop", "length"):
        assert delta("vllm:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(name + "_count") == count, name
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == generated
    # One inter-token latency per token after each request's first.
    assert delta("vllm:inter_token_latency_seconds_count") == generated - count
    assert delta("stormserve:token_queue_wait_seconds_count") == generated
    assert delta("vllm:iteration_tokens_total_sum") == prompt + generated
    assert delta("vllm:prefix_cache_queries_total") >= prompt
    assert delta("vllm:prefix_cache_hits_total") > 0
    edge_after = scrape(urls["http_edge"])[1]
    chat = {"method": "POST", "route": "/v1/chat/completions", "code": "200"}
    assert total(edge_after, "stormserve:http_requests_total", **chat) \
        - total(edge_before, "stormserve:http_requests_total", **chat) == count

    for name, bounds in VLLM_HISTOGRAMS.items():
        les = sorted({float(dict(labels)["le"]) for n, labels in after if n == name + "_bucket"})
        assert les == [float(b) for b in bounds] + [float("inf")], name


def leave_mid_stream(url: str, index: int) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 1.0, "seed": index,
            "messages": [{"role": "user", "content": f"Tell a long story about the number {index}."}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3 + index % 5:
                return  # the client goes away: the connection closes


def test_gauges_return_to_idle_after_a_disconnect_storm(urls, base_url):
    def idle(samples):
        return (total(samples, "vllm:num_requests_running") == 0 and total(samples, "vllm:num_requests_waiting") == 0
                and total(samples, "vllm:kv_cache_usage_perc") == 0)

    assert wait_for(lambda: idle(scheduler_samples(urls))), "not idle before the storm"
    before = scheduler_samples(urls)
    with ThreadPoolExecutor(24) as pool:
        list(pool.map(lambda i: leave_mid_stream(base_url, i), range(48)))
    samples = wait_for(lambda: (s := scheduler_samples(urls)) and idle(s) and s, timeout_s=60)
    assert samples, f"still busy: {scheduler_samples(urls)}"
    assert total(samples, "stormserve:kv_blocks_used") == 0
    aborted = total(samples, "vllm:request_success_total", finished_reason="abort") \
        - total(before, "vllm:request_success_total", finished_reason="abort")
    assert 0 < aborted <= 48
    assert total(samples, "stormserve:worker_healthy") == 1


def test_the_access_log_line_carries_the_id_the_client_saw(chain, base_url):
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    refused = httpx.post(base_url + "/v1/chat/completions", json={**body, "max_tokens": -1}, timeout=60)
    assert reply.headers["x-request-id"] == reply.json()["id"]
    assert refused.status_code == 422
    log = chain.log_dir / "http_edge.log"
    found = {}
    for answer, status in ((reply, 200), (refused, 422)):
        request_id = answer.headers["x-request-id"]
        lines = wait_for(lambda: [line for line in log.read_text().splitlines() if request_id in line], 10)
        assert len(lines) == 1 and f"POST /v1/chat/completions {status}" in lines[0]
        found[status] = lines[0]
    usage = reply.json()["usage"]
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}" in found[200]
    assert "error_code=422" in found[422]
