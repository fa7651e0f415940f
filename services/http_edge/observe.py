"""What the edge notes about every request: its id, its metrics and one access-log line.

Each request gets an id up front, used as the chat completion's `id` and sent
back in `X-Request-Id` on every answer, errors included, so the id in a log
line is the one the client saw. When the app is done (a whole stream
included) one line goes to the `stormserve.access` logger: method, path,
status, model, tokens in and out, time to the first token, duration, request
id, trace id and, for an error, its type and code. With
STORMSERVE_LOG_FORMAT=json the line is a JSON object whose keys are those fields.

With tracing on (services/common/tracing.py) every request is a server span,
child of the client's W3C `traceparent` when it sent one, and the calls it makes
carry it on; the trace id logged is that span's. With tracing off, the trace id
logged is the one of a valid `traceparent` header.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from stormserve.chat.v1 import chat_pb2
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common import tracing
from services.http_edge.convert import new_request_id

if TYPE_CHECKING:  # metrics.py imports errors.py, which reads the record
    from services.http_edge.metrics import EdgeMetrics

access_log = logging.getLogger("stormserve.access")

# Set by the EdgeError handler (errors.py): the error a request was answered with.
ERROR_SCOPE_KEY = "stormserve.error"
RECORD_SCOPE_KEY = "stormserve.record"


@dataclass
class RequestRecord:
    """Filled in by the chat handler as the reply goes by."""

    request_id: str
    start: float  # time.monotonic()
    model: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_s: float | None = None

    def note(self, chunk: chat_pb2.ChatChunk) -> None:
        """A chunk of the reply: its first output and its usage."""
        if self.first_token_s is None and chunk.choices:
            self.first_token_s = time.monotonic() - self.start
        if chunk.HasField("usage"):
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens


def record_of(scope: Scope) -> RequestRecord | None:
    return scope.get(RECORD_SCOPE_KEY)


def _trace_headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())
            if name in (b"traceparent", b"tracestate")}


def header_trace_id(scope: Scope) -> str | None:
    """The trace id of a valid W3C `traceparent` header (version-traceid-spanid-flags)."""
    value = _trace_headers(scope).get("traceparent")
    context = tracing.span_context_of(value) if value else None
    return None if context is None else format(context.trace_id, "032x")


def _end_span(span: trace.Span, scope: Scope, record: RequestRecord, status: int, template: str) -> None:
    """The server span's attributes (HTTP and OpenTelemetry gen_ai conventions), then its end."""
    span.update_name(f"{scope['method']} {template}")
    attributes = {
        "http.request.method": scope["method"],
        "url.path": scope.get("path", ""),
        "http.route": template,
        "http.response.status_code": status,
        "stormserve.request_id": record.request_id,
    }
    if record.model:
        attributes.update({"gen_ai.operation.name": "chat", "gen_ai.request.model": record.model,
                           "gen_ai.response.id": record.request_id})
    if record.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
    if record.completion_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = record.completion_tokens
    if record.first_token_s is not None:
        attributes["gen_ai.latency.time_to_first_token"] = record.first_token_s
    span.set_attributes(attributes)
    if status >= 500:
        span.set_status(trace.StatusCode.ERROR)
    span.end()


class ObserveMiddleware:
    """Plain ASGI (no per-chunk work on streams beyond noting the status)."""

    def __init__(self, app: ASGIApp, metrics: EdgeMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(new_request_id(), time.monotonic())
        scope[RECORD_SCOPE_KEY] = record
        status = 500  # an exception that escapes every handler ends as a 500
        span = token = None
        if tracing.enabled:
            parent = tracing.extract(_trace_headers(scope))
            span = tracing.tracer.start_span(f"{scope['method']}", context=parent, kind=trace.SpanKind.SERVER)
            token = tracing.attach(trace.set_span_in_context(span))

        async def noting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", record.request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        finally:
            duration_s = time.monotonic() - record.start
            route = scope.get("route")
            # The route's template, never the raw path: a fixed, small label set.
            template = getattr(route, "path", None) or "unmatched"
            error = scope.get(ERROR_SCOPE_KEY)
            self.metrics.record(scope["method"], template, status, error, duration_s)
            trace_id = header_trace_id(scope)
            if span is not None:
                tracing.detach(token)
                _end_span(span, scope, record, status, template)
                trace_id = tracing.trace_id_hex(span)
            if access_log.isEnabledFor(logging.INFO):
                _log_access(scope, record, status, error, duration_s, trace_id)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _log_access(scope: Scope, record: RequestRecord, status: int, error, duration_s: float,
                trace_id: str | None) -> None:
    fields = {
        "method": scope["method"],
        "path": scope.get("path", ""),
        "status": status,
        "model": record.model or None,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_ms": _ms(record.first_token_s),
        "duration_ms": _ms(duration_s),
        "request_id": record.request_id,
        "trace_id": trace_id,
    }
    if error is not None:
        fields["error_type"], fields["error_code"] = error.error_type, error.code
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("method", "path", "status"))
    access_log.info("%s %s %d %s", fields["method"], fields["path"], status, text, extra={"fields": fields})
