"""The engine through the real chain: greedy text under heavy concurrency, two
workers behind one scheduler (placement, prefix caching, several decode steps a
message), and a tiny KV pool that forces preemption."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.common.errors import WORKER_LOST
from tests.e2e.conftest import MODEL, load_reader, running_chain, scrape, total

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    # float32: the tests compare texts across prefix-cache hits and batch
    # compositions, which move bfloat16 logits (docs: fields and replies, reproducibility).
    # Up to four decode steps a message: every test here runs with them.
    with running_chain(tmp_path_factory.mktemp("two-workers"), num_workers=2,
                       env={"STORMSERVE_DTYPE": "float32", "STORMSERVE_MAX_DECODE_STEPS": "4"}) as (chain, stub):
        yield chain, load_reader(stub)


@pytest.fixture(scope="module")
def tiny_kv(tiny_kv_chain_and_stub):
    chain, stub = tiny_kv_chain_and_stub
    return chain, load_reader(stub)


def client_for(chain):
    from openai import OpenAI

    return OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def ask(client, messages, max_tokens: int = 16, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                          extra_body=extra or None)


# Two logprobs closer than this are a tie that float32 rounding may break either way:
# another batch composition changes the logits in about their sixth digit.
NEAR_TIE = 1e-3


def test_heavy_concurrency_gives_the_single_stream_greedy_tokens(openai_client):
    """24 requests at once (prefill chunks beside decodes, batches of up to 24)
    against each alone, in float32: the same tokens, or a first difference where
    the two best candidates were a near-tie."""
    messages = [[{"role": "user", "content": f"{q} Answer in detail, reason {i}."}]
                for i in range(6) for q in QUESTIONS]

    def run(m):
        return openai_client.chat.completions.create(
            model=MODEL, messages=m, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True})

    alone = [run(m) for m in messages]
    with ThreadPoolExecutor(len(messages)) as pool:
        together = list(pool.map(run, messages))
    assert max(b for r in together for b in r.usage.model_extra["batch_size"]) >= len(messages) // 2
    for solo, crowd in zip(alone, together):
        a, b = solo.choices[0].logprobs.content, crowd.choices[0].logprobs.content
        assert len(a) == len(b) == 24
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x.token != y.token), None)
        if i is None:
            continue
        best, second = a[i].top_logprobs[:2]
        assert best.logprob - second.logprob < NEAR_TIE and b[i].token == second.token, (
            f"token {i} differs ({a[i].token!r} alone, {b[i].token!r} under load) and was no near-tie: "
            f"{[(t.token, t.logprob) for t in a[i].top_logprobs]}")


def test_concurrent_requests_complete_and_both_workers_get_work(two_workers):
    chain, get_load = two_workers
    client = client_for(chain)
    questions = [f"{q} (request {i})" for i in range(2) for q in QUESTIONS]
    with ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(lambda q: ask(client, [{"role": "user", "content": q}]), questions))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    assert all(r.usage.completion_tokens > 0 for r in replies)
    workers = get_load().workers
    assert len(workers) == 2 and all(w.is_ready for w in workers)
    assert all(w.num_sequences > 0 for w in workers), workers
    assert all(w.num_free_kv_blocks == w.num_kv_blocks for w in workers)  # nothing leaked


def test_repeated_prompt_and_second_turn_are_served_from_the_prefix_cache(two_workers):
    chain, _ = two_workers
    client = client_for(chain)
    turn1 = [{"role": "user", "content": "Write one sentence about the sea, then one about mountains."}]
    first = ask(client, turn1, max_tokens=24)
    again = ask(client, turn1, max_tokens=24)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now one about rivers."}]
    second = ask(client, turn2)
    # The second turn's prompt starts with the whole first turn: its full blocks are reused.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_several_decode_steps_a_message_give_the_text_of_one_step_a_message(two_workers, openai_client):
    """This chain's scheduler runs up to four decode steps a message where every
    running sequence decodes (max_decode_steps): the greedy text of the session's
    chain, which runs one a message, and fewer messages than steps."""
    chain, _ = two_workers
    client = client_for(chain)
    messages = [[{"role": "user", "content": f"{q} Explain at length."}] for q in QUESTIONS[:2]]

    def counts():
        samples = scrape(chain.metrics_urls["scheduler"])[1]
        return (total(samples, "stormserve:step_messages_total"),
                total(samples, "stormserve:step_duration_seconds_count"))

    before = counts()
    with ThreadPoolExecutor(len(messages)) as pool:  # one on each worker
        several = list(pool.map(lambda m: ask(client, m, max_tokens=48, ignore_eos=True), messages))
    sent, steps = (a - b for a, b in zip(counts(), before))
    one = [ask(openai_client, m, max_tokens=48, ignore_eos=True) for m in messages]
    assert [r.choices[0].message.content for r in several] == [r.choices[0].message.content for r in one]
    assert all(r.usage.completion_tokens == 48 for r in several)
    assert steps >= 2 * 48 and sent < steps * 0.6, (sent, steps)


def test_preemption_under_a_tiny_kv_pool_keeps_every_request_and_its_text(tiny_kv):
    chain, get_load = tiny_kv
    client = client_for(chain)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    # ignore_eos: every answer runs its full length, so four at once need ~4 x 5 blocks of 8.
    alone = [ask(client, m, max_tokens=40, ignore_eos=True).choices[0].message.content for m in messages]
    before = get_load().workers[0]
    with ThreadPoolExecutor(len(messages)) as pool:
        together = list(pool.map(lambda m: ask(client, m, max_tokens=40, ignore_eos=True), messages))
    after = get_load().workers[0]
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to run out"
    assert [r.choices[0].message.content for r in together] == alone
    assert after.num_free_kv_blocks == after.num_kv_blocks and after.num_running == 0


def test_a_dead_worker_fails_only_its_requests_and_rejoins_when_restarted(two_workers):
    # Last in the module: it kills worker1 and brings it back.
    from openai import APIStatusError

    chain, get_load = two_workers
    client = client_for(chain)
    long = {"ignore_eos": True}

    def generate(question: str):
        try:
            return ask(client, [{"role": "user", "content": question}], max_tokens=300, **long)
        except APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(generate, f"Tell a long story number {i}.") for i in range(2)]
        # Both requests placed (the least loaded worker takes each), then kill one worker.
        deadline = time.monotonic() + 120
        while not all(w.num_running == 1 for w in get_load().workers):
            assert time.monotonic() < deadline, get_load()
            time.sleep(0.2)
        chain.procs["worker1"].kill()
        outcomes = [f.result(timeout=600) for f in futures]

    failed = [o for o in outcomes if isinstance(o, APIStatusError)]
    assert len(failed) == 1, outcomes
    # 503 when the worker died before the request's first token, else a 500
    # generation error; either way the body says the worker was lost, and names no address.
    body = failed[0].response.text
    assert failed[0].status_code in (500, 503) and WORKER_LOST in body and "127.0.0.1" not in body, body
    assert sum(o.usage.completion_tokens == 300 for o in outcomes if o not in failed) == 1

    # The scheduler keeps serving on the live worker.
    assert ask(client, [{"role": "user", "content": QUESTIONS[0]}]).choices[0].finish_reason in ("stop", "length")
    assert [w.is_ready for w in get_load().workers] == [True, False]

    chain.procs["worker1"].wait()
    chain.restart("worker1")
    deadline = time.monotonic() + 300
    while get_load().num_workers_ready < 2:
        assert time.monotonic() < deadline, "worker1 did not rejoin"
        time.sleep(0.5)
    before = get_load().workers[1].num_sequences
    # Several at once: the less loaded worker takes each. worker0's cache holds the
    # chat template's first tokens, too small a share of a prompt to draw them.
    questions = [f"{q} (again {i})" for i in range(2) for q in QUESTIONS]
    with ThreadPoolExecutor(len(questions)) as pool:
        replies = list(pool.map(lambda q: ask(client, [{"role": "user", "content": q}], max_tokens=32), questions))
    assert all(r.usage.completion_tokens > 0 for r in replies)
    workers = get_load().workers
    assert workers[1].num_sequences > before  # it takes work again
    assert all(w.num_free_kv_blocks == w.num_kv_blocks for w in workers)
