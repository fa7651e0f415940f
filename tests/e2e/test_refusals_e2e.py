"""A blast radius of one, on the real chain: a GenerateRequest the worker cannot
serve (top_logprobs 1000, temperature NaN), sent straight to the scheduler
while four ordinary streams run, fails alone with INVALID_ARGUMENT naming the
field; the four finish as they would have, and the next request is served at
once (the worker was never taken out of service)."""
from __future__ import annotations

import math
import threading

import grpc
import pytest

from stormserve.scheduler.v1 import scheduler_pb2

MAX_TOKENS = 48


def generate_request(request_id: str, prompt_start: int, **sampling) -> scheduler_pb2.GenerateRequest:
    return scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=list(range(prompt_start, prompt_start + 24)),
        sampling=scheduler_pb2.SamplingParams(**{"temperature": 0.0, **sampling}),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))


class Stream(threading.Thread):
    """One ordinary request read to its end on its own thread; `started` is set
    with its first message."""

    def __init__(self, stub, message: scheduler_pb2.GenerateRequest):
        super().__init__(daemon=True)
        self.stub, self.message = stub, message
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.finish_reason = 0
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for reply in self.stub.Generate(self.message, timeout=300):
                self.tokens += [t.token_id for t in reply.tokens]
                self.finish_reason = reply.finish_reason or self.finish_reason
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()


@pytest.mark.parametrize("sampling, field", [
    ({"top_logprobs": 1000}, "top_logprobs"),
    ({"temperature": math.nan}, "temperature"),
], ids=["top_logprobs 1000", "temperature NaN"])
def test_a_request_the_worker_cannot_serve_fails_alone(chain_and_stub, sampling, field):
    _, stub = chain_and_stub
    name = field.replace("_", "-")
    streams = [Stream(stub, generate_request(f"refusal-{name}-ok-{i}", 2000 + 100 * i)) for i in range(4)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(120)
    assert not any(s.error for s in streams) and not any(s.finish_reason for s in streams), "already over"

    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(generate_request(f"refusal-{name}-bad", 3000, **sampling), timeout=120))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.details()
    assert any(not s.finish_reason for s in streams), "the ordinary streams were over before the refusal came"

    for stream in streams:
        stream.join(300)
        assert stream.error is None, stream.error
        assert len(stream.tokens) == MAX_TOKENS
        assert stream.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    after = Stream(stub, generate_request(f"refusal-{name}-after", 4000))
    after.run()
    assert after.error is None and len(after.tokens) == MAX_TOKENS
    assert after.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
