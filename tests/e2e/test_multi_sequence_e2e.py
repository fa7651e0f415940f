"""Several sequences per request (n, best_of) straight on the scheduler's gRPC
Generate, with the real worker and model: interleaved choices, shared prompt KV,
best_of selection, cancellation and preemption, and nothing leaked."""
from __future__ import annotations

import time

import grpc
import pytest

from services.scheduler.choices import sibling_seed
from stormserve.scheduler.v1 import scheduler_pb2
from tests.e2e.conftest import load_reader

# Over 16 tokens (one KV block): siblings share its first full block.
PROMPT = list(range(1000, 1020))


def generate_request(request_id: str, n=None, best_of=None, seed=1234, max_tokens=12, top_logprobs=None,
                     ignore_eos=False) -> scheduler_pb2.GenerateRequest:
    sampling = scheduler_pb2.SamplingParams(temperature=1.0, seed=seed)
    if top_logprobs is not None:
        sampling.top_logprobs = top_logprobs
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling,
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=ignore_eos))
    if n is not None:
        request.n = n
    if best_of is not None:
        request.best_of = best_of
    return request


class Choice:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.messages = 0
        self.finish_reason = 0
        self.cumulative_logprob: float | None = None
        self.cached_tokens = 0


def collect(stub, request) -> tuple[dict[int, Choice], list[int]]:
    """Choices by index, and the index of every message in arrival order."""
    choices: dict[int, Choice] = {}
    order = []
    for reply in stub.Generate(request, timeout=300):
        choice = choices.setdefault(reply.index, Choice())
        assert not choice.finish_reason, "a message after the choice's last one"
        order.append(reply.index)
        if choice.messages == 0:
            assert reply.prompt_tokens == len(PROMPT)
            choice.cached_tokens = reply.cached_tokens
        choice.messages += 1
        choice.tokens += [t.token_id for t in reply.tokens]
        choice.logprobs += [t.logprob for t in reply.tokens if t.HasField("logprob")]
        if reply.finish_reason:
            choice.finish_reason = reply.finish_reason
            if reply.HasField("cumulative_logprob"):
                choice.cumulative_logprob = reply.cumulative_logprob
    return choices, order


def wait_idle(get_load) -> scheduler_pb2.WorkerLoad:
    deadline = time.monotonic() + 30
    while True:
        worker = get_load().workers[0]
        if (worker.num_running == 0 and worker.num_waiting == 0) or time.monotonic() > deadline:
            return worker
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stub(chain_and_stub):
    return chain_and_stub[1]


def test_n_choices_stream_interleaved_and_share_the_prompt(stub, scheduler_load):
    choices, order = collect(stub, generate_request("multi-n", n=3, top_logprobs=0, ignore_eos=True))
    assert sorted(choices) == [0, 1, 2]
    assert all(c.finish_reason and c.tokens for c in choices.values())
    assert len({tuple(c.tokens) for c in choices.values()}) > 1  # sampled independently
    # Siblings fork from the first one's prompt: its full block is not recomputed.
    assert all(choices[i].cached_tokens >= 16 for i in (1, 2))
    for c in choices.values():  # logprobs asked: every token's, and their sum at the end
        assert len(c.logprobs) == len(c.tokens)
        assert c.cumulative_logprob == pytest.approx(sum(c.logprobs), abs=1e-3)
    # The choices stream side by side, not one after the other.
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)
    worker = wait_idle(scheduler_load)
    assert worker.num_free_kv_blocks == worker.num_kv_blocks


def test_best_of_sends_the_n_best_at_the_end_renumbered(stub, scheduler_load):
    best, order = collect(stub, generate_request("best-of", n=2, best_of=4))
    assert order == [0, 1]  # one message per choice, best first
    assert all(c.messages == 1 and c.finish_reason and c.tokens for c in best.values())
    assert all(not c.logprobs for c in best.values())  # ranked internally, not reported
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    worker = wait_idle(scheduler_load)
    assert worker.num_free_kv_blocks == worker.num_kv_blocks


def test_invalid_n_is_refused(stub):
    with pytest.raises(grpc.RpcError) as info:
        collect(stub, generate_request("bad-best-of", n=3, best_of=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_beam_search_sends_the_n_best_at_the_end_and_frees_every_beam(stub, scheduler_load):
    request = generate_request("beam", n=2, best_of=4, top_logprobs=2)
    request.use_beam_search = True
    choices, order = collect(stub, request)
    assert order == [0, 1]  # one message per choice, best first
    assert all(c.messages == 1 and c.tokens and c.finish_reason for c in choices.values())
    assert all(len(c.logprobs) == len(c.tokens) for c in choices.values())
    scores = [choices[i].cumulative_logprob / len(choices[i].tokens) for i in (0, 1)]
    assert scores[0] >= scores[1]
    assert choices[0].tokens != choices[1].tokens
    worker = wait_idle(scheduler_load)
    assert worker.num_free_kv_blocks == worker.num_kv_blocks


def test_cancel_and_abort_free_every_sibling(stub, scheduler_load):
    call = stub.Generate(generate_request("cancel-me", n=4, max_tokens=200, ignore_eos=True), timeout=300)
    next(iter(call))
    call.cancel()
    aborted = stub.Generate(generate_request("abort-me", n=3, max_tokens=200, ignore_eos=True), timeout=300)
    replies = iter(aborted)
    next(replies)
    assert stub.Abort(scheduler_pb2.AbortRequest(request_id="abort-me"), timeout=10).found
    ends = {r.index: r.finish_reason for r in replies if r.finish_reason}
    assert len(ends) == 3 and set(ends.values()) == {scheduler_pb2.FINISH_REASON_ABORT}
    # One choice only (a stop string ended it, say): the others run to their end.
    call = stub.Generate(generate_request("abort-one", n=3, max_tokens=30, ignore_eos=True), timeout=300)
    replies = iter(call)
    next(replies)
    assert stub.Abort(scheduler_pb2.AbortRequest(request_id="abort-one", index=1), timeout=10).found
    ends = {r.index: r.finish_reason for r in replies if r.finish_reason}
    assert ends == {0: scheduler_pb2.FINISH_REASON_LENGTH, 1: scheduler_pb2.FINISH_REASON_ABORT,
                    2: scheduler_pb2.FINISH_REASON_LENGTH}
    worker = wait_idle(scheduler_load)
    assert worker.num_running == 0 and worker.num_free_kv_blocks == worker.num_kv_blocks


@pytest.fixture(scope="module")
def tiny_kv_stub(tiny_kv_chain_and_stub):
    # The shared tiny pool: four siblings of 20 + 40 tokens do not fit at once.
    stub = tiny_kv_chain_and_stub[1]
    return stub, load_reader(stub)


def test_seeded_choices_are_reproducible_and_best_of_picks_the_best(tiny_kv_stub):
    stub, get_load = tiny_kv_stub
    first, _ = collect(stub, generate_request("seeded", n=3))
    again, _ = collect(stub, generate_request("seeded-again", n=3))
    assert {i: c.tokens for i, c in again.items()} == {i: c.tokens for i, c in first.items()}
    alone, _ = collect(stub, generate_request("seeded-alone"))
    assert alone[0].tokens == first[0].tokens  # sibling 0 uses the request's own seed
    # best_of ranks the same siblings that n = best_of streams.
    every, _ = collect(stub, generate_request("streamed-4", n=4, top_logprobs=0))
    best, _ = collect(stub, generate_request("best-2-of-4", n=2, best_of=4))
    ranked = sorted(every.values(), key=lambda c: -c.cumulative_logprob)
    assert [best[0].tokens, best[1].tokens] == [ranked[0].tokens, ranked[1].tokens]
    worker = wait_idle(get_load)
    assert worker.num_free_kv_blocks == worker.num_kv_blocks


def test_preempted_siblings_recompute_to_the_text_each_seed_gives_alone(tiny_kv_stub):
    stub, get_load = tiny_kv_stub
    before = get_load().workers[0]
    together, _ = collect(stub, generate_request("tiny-n4", n=4, max_tokens=40, ignore_eos=True))
    after = wait_idle(get_load)
    assert after.num_preemptions > before.num_preemptions, "the pool was meant to run out"
    for i, choice in together.items():
        request = generate_request(f"tiny-alone-{i}", seed=sibling_seed(1234, i), max_tokens=40, ignore_eos=True)
        alone, _ = collect(stub, request)
        assert alone[0].tokens == choice.tokens, i
    worker = wait_idle(get_load)
    assert worker.num_free_kv_blocks == worker.num_kv_blocks
