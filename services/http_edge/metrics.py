"""The edge's Prometheus metrics, on its own HTTP port at `/metrics`.

The edge counts what only it sees: HTTP answers by route and status, and the
requests it refuses before they reach the chain (validation, auth, timeout; a
full queue is refused, and counted, by the scheduler). Every request passes
one edge, so a sum over edge replicas counts each once. The engine-level
`vllm:` series come from the scheduler, never from here.

What the HTTP protocol answers itself before the app sees a request
(malformed HTTP 400, a head too large 431, a late head 408; see
http_protocol.py) is counted too, under route `unparsed` and method `_OTHER`:
no route was matched, and the method may not have been read.
"""
from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.common.metrics import REQUEST_LATENCY_BUCKETS, process_registry
from services.http_edge.errors import CODE_TIMEOUT, EdgeError

REJECTION_REASONS = ("validation", "auth", "timeout")
# 424: a prompt (or prompt + max_tokens) too long for the model or the KV pool.
_VALIDATION_STATUSES = frozenset({400, 413, 415, 422, 424, 431})


def rejection_reason(status: int, error: EdgeError | None) -> str | None:
    """Why a request was refused before it ran, or None when it was not."""
    if status == 408 or (error is not None and error.code == CODE_TIMEOUT):
        return "timeout"
    if status == 401:
        return "auth"
    if status in _VALIDATION_STATUSES:
        return "validation"
    return None


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = process_registry()
        self.http_requests = Counter("stormserve:http_requests", "HTTP requests answered, by route and status code.",
                                     ("method", "route", "code"), registry=self.registry)
        self.http_duration = Histogram(
            "stormserve:http_request_duration_seconds",
            "Time from request start until the last byte of the answer (a whole stream), by route.",
            ("route",), buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.rejected = Counter("stormserve:requests_rejected", "Requests refused before they ran, by reason.",
                                ("reason",), registry=self.registry)
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)

    def record(self, method: str, route: str, status: int, error: EdgeError | None, duration_s: float) -> None:
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_duration.labels(route).observe(duration_s)
        self._count_rejection(status, error)

    def record_refusal(self, error: EdgeError) -> None:
        """A refusal of the HTTP protocol itself, before any route (no duration: nothing ran)."""
        self.http_requests.labels("_OTHER", "unparsed", str(error.status)).inc()
        self._count_rejection(error.status, error)

    def _count_rejection(self, status: int, error: EdgeError | None) -> None:
        reason = rejection_reason(status, error)
        if reason is not None:
            self.rejected.labels(reason).inc()
