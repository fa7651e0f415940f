"""The tokenizer's key decision and per-key limits on a fake clock: requests per
second, streams at once and tokens per minute, each refused with
RESOURCE_EXHAUSTED, the RATE_LIMITED reason and a retry delay, and counted by
the key's name, never the key."""
from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.api_keys import NOT_PASSED, WRONG_KEY, KeyStore
from services.common.errors import RATE_LIMITED, ServiceError
from services.tokenizer.key_gate import OPEN, KeyGate, KeyMetrics

KEY = "sk-secret-123"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate_with(tmp_path, settings: str) -> tuple[KeyGate, Clock, CollectorRegistry]:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY} name=team-a {settings}\n")
    clock, registry = Clock(), CollectorRegistry()
    return KeyGate(KeyStore(key_file=str(key_file)), KeyMetrics(registry), clock), clock, registry


AUTH = {"authorization": f"Bearer {KEY}"}


def refused(gate: KeyGate, metadata=AUTH) -> ServiceError:
    with pytest.raises(ServiceError) as raised:
        with gate.admit(metadata):
            pass
    return raised.value


def test_without_keys_every_call_is_open() -> None:
    gate = KeyGate(KeyStore())
    with gate.admit({}) as admission:
        assert admission is OPEN
    assert gate.authenticate(()) is None


def test_a_missing_or_unknown_key_is_unauthenticated(tmp_path) -> None:
    gate, _, registry = gate_with(tmp_path, "")
    for metadata, message in (({}, NOT_PASSED), ({"authorization": "Bearer sk-other"}, WRONG_KEY),
                              ({"authorization": KEY}, NOT_PASSED)):
        error = refused(gate, metadata)
        assert (error.code, error.message) == (grpc.StatusCode.UNAUTHENTICATED, message)
    with pytest.raises(ServiceError):
        gate.authenticate((("authorization", "Bearer nope"),))
    assert gate.authenticate((("authorization", f"Bearer {KEY}"),)).name == "team-a"
    text = generate_latest(registry).decode()
    assert 'stormserve:api_key_refusals_total{reason="missing"} 2.0' in text
    assert 'stormserve:api_key_refusals_total{reason="unknown"} 2.0' in text


def test_requests_per_second_allow_a_one_second_burst_then_wait(tmp_path) -> None:
    gate, clock, _ = gate_with(tmp_path, "requests_per_second=2")
    for _ in range(2):
        with gate.admit(AUTH):
            pass
    error = refused(gate)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and error.error_reason == RATE_LIMITED
    assert error.retry_after_s == 1
    assert error.message == "API key team-a is over its limit of 2 requests per second; retry after 1 s"
    clock.now += 0.5  # one request's worth
    with gate.admit(AUTH):
        pass
    assert refused(gate).retry_after_s == 1


def test_concurrent_streams_are_bounded_while_they_run(tmp_path) -> None:
    gate, _, registry = gate_with(tmp_path, "max_concurrent=2")
    first, second = gate.admit(AUTH), gate.admit(AUTH)
    first.__enter__(), second.__enter__()
    error = refused(gate)
    assert "2 streams at once" in error.message and error.retry_after_s == 1
    assert 'stormserve:api_key_streams{key="team-a"} 2.0' in generate_latest(registry).decode()
    first.__exit__(None, None, None)
    with gate.admit(AUTH):
        pass
    second.__exit__(None, None, None)
    assert 'stormserve:api_key_streams{key="team-a"} 0.0' in generate_latest(registry).decode()


def test_tokens_per_minute_are_taken_when_known_and_the_next_call_waits_for_the_refill(tmp_path) -> None:
    gate, clock, registry = gate_with(tmp_path, "tokens_per_minute=120")
    with gate.admit(AUTH) as admission:
        admission.add_tokens(170)  # more than the bucket held: it goes 50 below zero
    error = refused(gate)
    assert "120 tokens per minute" in error.message
    assert error.retry_after_s == 25  # 50 tokens at 2 per second
    clock.now += 24
    assert refused(gate).retry_after_s == 1
    clock.now += 1.5
    with gate.admit(AUTH):
        pass
    text = generate_latest(registry).decode()
    assert 'stormserve:api_key_tokens_total{key="team-a"} 170.0' in text
    assert 'stormserve:api_key_requests_total{key="team-a",outcome="admitted"} 2.0' in text
    assert 'stormserve:api_key_requests_total{key="team-a",outcome="tokens_limited"} 2.0' in text
    assert KEY not in text
