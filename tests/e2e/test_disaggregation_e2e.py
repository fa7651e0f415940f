"""Prefill/decode disaggregation through the real chain: one prefill and one
decode worker (Chain with worker roles, as STORMSERVE_DISAGGREGATE=1P1D
starts them), KV blocks moved by Mooncake's TCP transport. Every answer is
held to the colocated float32 chain's: greedy and seeded text, n = 2 and
beam search; the prefix cache hits on both sides; and where the decode
worker's transfer engine cannot be reached (it says peers write to it at an
address nothing answers on), or its connection is cut, every request still
answers: recomputed there, or sent on the second try."""
from __future__ import annotations

import shutil
import subprocess
import time

import psutil
import pytest

from stormserve.scheduler.v1 import scheduler_pb2
from tests.e2e.conftest import load_reader, running_chain, scrape, total
from tests.e2e.test_multi_sequence_e2e import collect, generate_request

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine (make setup installs it)")

# Unroutable (TEST-NET-1): a transfer engine that says it is there is never reached.
UNREACHABLE = "192.0.2.1"
# Long enough for several KV blocks of 16 tokens, distinct from every other test's.
PROMPTS = [list(range(2000 + 7 * i, 2000 + 7 * i + 70)) for i in range(3)]


def disaggregated(tmp_path_factory, name: str, env: dict[str, str] | None = None):
    env = {"STORMSERVE_KV_CACHE_MIB": "256", "STORMSERVE_DTYPE": "float32", **(env or {})}
    with running_chain(tmp_path_factory.mktemp(name), num_workers=2, env=env,
                       worker_roles=["prefill", "decode"]) as running:
        yield running


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    yield from disaggregated(tmp_path_factory, "1p1d")


@pytest.fixture(scope="module")
def pd_cut(tmp_path_factory):
    yield from disaggregated(tmp_path_factory, "1p1d-cut", {"STORMSERVE_KV_TRANSFER_HOST": UNREACHABLE})


def greedy(request_id: str, prompt: list[int], max_tokens: int = 16, **sampling) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=scheduler_pb2.SamplingParams(temperature=0.0, **sampling),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def tokens(stub, request) -> tuple[list[int], int]:
    """The one choice's tokens, and the prompt tokens its first message says were cached."""
    got, cached = [], None
    for reply in stub.Generate(request, timeout=300):
        assert reply.index == 0
        cached = reply.cached_tokens if cached is None else cached
        got += [t.token_id for t in reply.tokens]
    return got, cached


def transfers(chain) -> dict[str, float]:
    samples = scrape(chain.metrics_urls["scheduler"])[1]
    found = {outcome: total(samples, "stormserve:kv_transfers_total", outcome=outcome)
             for outcome in ("sent", "retried", "recomputed", "kept")}
    found["bytes"] = total(samples, "stormserve:kv_transfer_bytes_total")
    found["timed"] = total(samples, "stormserve:kv_transfer_duration_seconds_count")
    found["in_flight"] = total(samples, "stormserve:kv_transfers_in_flight")
    return found


def workers_idle(stub) -> list[scheduler_pb2.WorkerLoad]:
    deadline = time.monotonic() + 30
    while True:
        workers = load_reader(stub)().workers
        if all(w.num_running == w.num_waiting == 0 for w in workers) or time.monotonic() > deadline:
            return workers


def test_greedy_and_seeded_text_equal_the_colocated_chains_and_the_kv_moved(pd, chain_and_stub):
    chain, stub = pd
    reference = chain_and_stub[1]
    before = transfers(chain)
    for i, prompt in enumerate(PROMPTS):
        assert tokens(stub, greedy(f"pd-{i}", prompt))[0] == tokens(reference, greedy(f"co-{i}", prompt))[0]
    seeded = scheduler_pb2.GenerateRequest(
        request_id="pd-seeded", prompt_token_ids=PROMPTS[0][:40],
        sampling=scheduler_pb2.SamplingParams(temperature=0.9, seed=4321),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=16, ignore_eos=True))
    mine = tokens(stub, seeded)[0]
    seeded.request_id = "co-seeded"
    assert mine == tokens(reference, seeded)[0]
    after = transfers(chain)
    assert after["sent"] - before["sent"] == after["timed"] - before["timed"] == len(PROMPTS) + 1
    assert after["bytes"] > before["bytes"] and after["in_flight"] == 0
    for worker in workers_idle(stub):  # nothing held on either side once they are done
        assert worker.num_free_kv_blocks == worker.num_kv_blocks


def test_a_prefix_hit_on_each_side(pd):
    chain, stub = pd
    prompt = list(range(3000, 3070))  # 4 full blocks and a partial one
    first = transfers(chain)
    tokens(stub, greedy("hit-1", prompt, max_tokens=4))
    second = transfers(chain)
    again, cached = tokens(stub, greedy("hit-2", prompt, max_tokens=4))
    third = transfers(chain)
    assert cached == 64  # the prefill worker's prefix cache: every full block but the one with the last token
    sent_first, sent_again = second["bytes"] - first["bytes"], third["bytes"] - second["bytes"]
    # The decode worker's cache holds the 4 full blocks already: only the partial one moves.
    assert sent_again * 5 == sent_first, (sent_first, sent_again)


def test_n_2_and_beam_search_answer_as_colocated(pd, chain_and_stub):
    _, stub = pd
    reference = chain_and_stub[1]
    for make in (lambda rid: generate_request(rid, n=2, seed=99),
                 lambda rid: beam(generate_request(rid, n=2, best_of=3, top_logprobs=2))):
        mine, _ = collect(stub, make("pd-multi"))
        theirs, _ = collect(reference, make("co-multi"))
        assert {i: c.tokens for i, c in mine.items()} == {i: c.tokens for i, c in theirs.items()}
        assert len(mine) == 2


def beam(request: scheduler_pb2.GenerateRequest) -> scheduler_pb2.GenerateRequest:
    request.use_beam_search = True
    return request


def test_a_stream_through_the_edge_is_one_ordinary_stream(pd, chain):
    from openai import OpenAI

    answers = []
    for url in (pd[0].url, chain.url):
        client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name three colours of the sea."}],
            max_tokens=12, temperature=0, stream=True)
        answers.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    assert answers[0] and answers[0] == answers[1]


def test_transfers_that_cannot_reach_the_decode_worker_are_recomputed_there(pd_cut, chain_and_stub):
    chain, stub = pd_cut
    reference = chain_and_stub[1]
    for i, prompt in enumerate(PROMPTS[:2]):
        assert tokens(stub, greedy(f"cut-{i}", prompt))[0] == tokens(reference, greedy(f"co-cut-{i}", prompt))[0]
    counts = transfers(chain)
    assert counts["recomputed"] == 2 and counts["sent"] == counts["retried"] == 0 and counts["bytes"] == 0
    for worker in workers_idle(stub):
        assert worker.num_free_kv_blocks == worker.num_kv_blocks


def cut_transfer_connections(chain) -> int:
    """Cut (ss -K) every TCP connection of the prefill worker to the decode
    worker's transfer engine (its listening ports other than gRPC and metrics)."""
    prefill, decode = (psutil.Process(chain.procs[f"worker{i}"].pid) for i in (0, 1))
    served = {chain.worker_ports[1], chain.metrics_ports.get("worker1")}
    engine_ports = {c.laddr.port for c in decode.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port not in served}
    cut = 0
    for c in prefill.net_connections("tcp"):
        if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port in engine_ports:
            subprocess.run(["ss", "-K", "src", c.laddr.ip, "sport", "=", f":{c.laddr.port}"], check=True,
                           capture_output=True)
            cut += 1
    return cut


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to cut a connection")
def test_a_transfer_whose_connection_is_cut_is_tried_again_and_answers(pd, chain_and_stub):
    chain, stub = pd
    reference = chain_and_stub[1]
    tokens(stub, greedy("before-cut", list(range(4000, 4040)), max_tokens=2))  # the engines are connected
    assert cut_transfer_connections(chain) >= 1
    before = transfers(chain)
    prompt = list(range(4100, 4150))
    assert tokens(stub, greedy("after-cut", prompt))[0] == tokens(reference, greedy("co-after-cut", prompt))[0]
    after = transfers(chain)
    assert after["retried"] + after["recomputed"] - before["retried"] - before["recomputed"] == 1
