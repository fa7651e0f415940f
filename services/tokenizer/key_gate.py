"""The API-key decision for every ChatService and TokenizerService call, and
each key's limits: requests per second, streams at once, tokens per minute.

Every door leads here: the HTTP edge passes its client's credential on with
each call, and native gRPC, gRPC-Web and Envoy's transcoded JSON carry it as
`authorization: Bearer` metadata. A missing or unknown key is UNAUTHENTICATED
(the edge's 401 codes 702 / 801), a key past a limit RESOURCE_EXHAUSTED with
the RATE_LIMITED reason and a retry delay (429 with Retry-After).

Limits hold per tokenizer replica (docs: security): requests per second and
tokens per minute are token buckets that refill continuously, with a burst of
one second's requests and one minute's tokens; a call is let in while its
key's token bucket is above zero and its tokens (prompt and completion) are
taken when it ends, so a long answer can take the bucket below zero and the
next call waits until it refills."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.api_keys import ApiKey, KeyLimits, KeyRefused, KeyStore, metadata_token
from services.common.errors import RATE_LIMITED, ServiceError

class KeyMetrics:
    """Per key name (never the key): calls let in or refused, tokens, open streams."""

    def __init__(self, registry: CollectorRegistry):
        self.calls = Counter("stormserve:api_key_requests", "Chat calls by API key name and outcome: admitted, "
                             "or refused by a limit (rate, concurrency, tokens)", ["key", "outcome"],
                             registry=registry)
        self.tokens = Counter("stormserve:api_key_tokens", "Prompt and completion tokens by API key name",
                              ["key"], registry=registry)
        self.streams = Gauge("stormserve:api_key_streams", "Chat calls running by API key name", ["key"],
                             registry=registry)
        self.refused = Counter("stormserve:api_key_refusals", "Calls without a key or with an unknown one",
                               ["reason"], registry=registry)


@dataclass
class _Bucket:
    """Tokens refilling at `rate` per second up to `capacity`; may go negative."""

    capacity: float
    rate: float
    level: float = field(init=False)
    at: float = 0.0

    def __post_init__(self) -> None:
        self.level = self.capacity

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level

    def wait_s(self, below: float) -> int:
        """Whole seconds until the level is above `below`."""
        return max(1, math.ceil((below - self.level) / self.rate))


@dataclass
class _KeyState:
    limits: KeyLimits
    requests: _Bucket | None
    tokens: _Bucket | None
    streams: int = 0


class Admission:
    """One admitted call: `add_tokens` as they are known; closing ends it."""

    def __init__(self, gate: KeyGate | None = None, key: ApiKey | None = None, state: _KeyState | None = None):
        self._gate, self.key, self._state = gate, key, state

    def add_tokens(self, num_tokens: int) -> None:
        if self._gate is not None and self.key is not None and num_tokens > 0:
            self._gate.take_tokens(self.key, self._state, num_tokens)


OPEN = Admission()


class KeyGate:
    def __init__(self, store: KeyStore, metrics: KeyMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.metrics = metrics
        self._clock = clock
        self._states: dict[str, _KeyState] = {}  # by key name: a key's rotated successor shares its limits

    def authenticate(self, metadata: Mapping[str, Any] | Any) -> ApiKey | None:
        """The caller's key (None when keys are off); UNAUTHENTICATED without a good one."""
        try:
            return self.store.lookup(metadata_token(metadata))
        except KeyRefused as refused:
            if self.metrics is not None:
                self.metrics.refused.labels("missing" if metadata_token(metadata) is None else "unknown").inc()
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, refused.message) from None

    @contextmanager
    def admit(self, metadata: Mapping[str, Any]) -> Iterator[Admission]:
        """A Chat call: authenticated, then let in under its key's limits, counted while it runs."""
        key = self.authenticate(metadata)
        if key is None:
            yield OPEN
            return
        state = self._state(key)
        self._check_limits(key, state)
        state.streams += 1
        if self.metrics is not None:
            self.metrics.calls.labels(key.name, "admitted").inc()
            self.metrics.streams.labels(key.name).inc()
        try:
            yield Admission(self, key, state)
        finally:
            state.streams -= 1
            if self.metrics is not None:
                self.metrics.streams.labels(key.name).dec()

    def take_tokens(self, key: ApiKey, state: _KeyState | None, num_tokens: int) -> None:
        if state is not None and state.tokens is not None:
            state.tokens.refill(self._clock())
            state.tokens.level -= num_tokens
        if self.metrics is not None:
            self.metrics.tokens.labels(key.name).inc(num_tokens)

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._states.get(key.name)
        limits = key.limits
        if state is None or state.limits != limits:  # new, or its limits changed with the key file
            now = self._clock()
            rps, tpm = limits.requests_per_second, limits.tokens_per_minute
            state = self._states[key.name] = _KeyState(
                limits, requests=_Bucket(max(1.0, rps), rps, at=now) if rps else None,
                tokens=_Bucket(float(tpm), tpm / 60.0, at=now) if tpm else None,
                streams=state.streams if state is not None else 0)
        return state

    def _check_limits(self, key: ApiKey, state: _KeyState) -> None:
        limits, now = key.limits, self._clock()
        if limits.max_concurrent and state.streams >= limits.max_concurrent:
            self._refuse(key, "concurrency", f"{limits.max_concurrent} streams at once", 1)
        if state.tokens is not None and state.tokens.refill(now) <= 0:
            self._refuse(key, "tokens", f"{limits.tokens_per_minute} tokens per minute", state.tokens.wait_s(0))
        if state.requests is not None:
            if state.requests.refill(now) < 1:
                self._refuse(key, "rate", f"{limits.requests_per_second:g} requests per second",
                             state.requests.wait_s(1))
            state.requests.level -= 1

    def _refuse(self, key: ApiKey, outcome: str, limit: str, retry_after_s: int) -> None:
        if self.metrics is not None:
            self.metrics.calls.labels(key.name, f"{outcome}_limited").inc()
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"API key {key.name} is over its limit of {limit}; retry after {retry_after_s} s",
                           RATE_LIMITED, retry_after_s)
