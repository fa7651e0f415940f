"""One error body for every failure the edge answers (reference §9.1):

    {"error": msg, "error_type": type, "code": int, "result": null, "message": msg}

`error`/`error_type` are MindIE's fields, `code`/`result`/`message` the product
page's. HTTP statuses follow MindIE; `code` is the documented code where one
exists (802 timeout, 9999 generation failure, 801/702 auth) and the HTTP status
otherwise (422 validation, 413 body size, 503 unavailable, 404 route).

| cause                                     | HTTP | error_type             | code |
|-------------------------------------------|------|------------------------|------|
| bad JSON, bad field, unknown model        | 422  | Input Validation Error | 422  |
| gRPC INVALID_ARGUMENT, NOT_FOUND          | 422  | Input Validation Error | 422  |
| body above maxRequestLength               | 413  | Payload Too Large      | 413  |
| gRPC INVALID_ARGUMENT, PAYLOAD_TOO_LARGE¹ | 413  | Payload Too Large      | 413  |
| gRPC OUT_OF_RANGE (prompt too long)       | 424  | Generation Error       | 9999 |
| gRPC UNAVAILABLE, RESOURCE_EXHAUSTED      | 503  | Service Unavailable    | 503  |
| gRPC RESOURCE_EXHAUSTED, RATE_LIMITED¹    | 429  | Too Many Requests      | 429  |
| e2eTimeout passed (request_timeout_s)     | 500  | Incomplete Generation  | 802  |
| gRPC DEADLINE_EXCEEDED                    | 500  | Incomplete Generation  | 802  |
| no `Authorization: Bearer` (keys set)     | 401  | Unauthorized           | 702  |
| bearer token matches no key               | 401  | Unauthorized           | 801  |
| gRPC UNAUTHENTICATED (the tokenizer's)    | 401  | Unauthorized           | 702 / 801² |
| gRPC PERMISSION_DENIED                    | 401  | Unauthorized           | 702  |
| any other gRPC status or edge failure     | 500  | Incomplete Generation  | 9999 |
| chat POST whose Content-Type is not JSON  | 415  | Unsupported Media Type | 415  |
| malformed HTTP (request line, framing)    | 400  | Bad Request            | 400  |
| head above max_header_kib / max_headers   | 431  | Request Header Fields Too Large | 431 |
| head or body slower than its read timeout | 408  | Request Timeout        | 408  |
| internal TLS on, no client certificate³   | 403  | Forbidden              | 403  |

¹ the status's google.rpc.ErrorInfo reason (services.common.errors): a
media part over its byte cap; an API key over one of its limits, answered
with the status's retry delay as Retry-After.
² 702 when no key was sent, 801 for a key that matches none, as the edge's own check.
³ any route but /health and /metrics (services/common/tls.py).

400, 431, 403 and the head's 408 are answered by the HTTP protocol itself
(http_protocol.py), the body's 408 by `read_body`; all of them close the connection.

The message of a gRPC status is shown only for the codes our services raise
for clients (services.common.errors.client_message); any other status, or a
details string the gRPC library wrote, reads as a fixed message for its code:
addresses, transport errors and exception text stay in the logs.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.api_keys import NOT_PASSED
from services.common.errors import (
    INTERNAL_ERROR, PAYLOAD_TOO_LARGE, RATE_LIMITED, client_message, error_reason, retry_after_s)
from services.common.validation import describe_validation
from services.http_edge.observe import ERROR_SCOPE_KEY, record_of

log = logging.getLogger(__name__)

INPUT_VALIDATION = "Input Validation Error"
TOO_LARGE = "Payload Too Large"
GENERATION = "Generation Error"
INCOMPLETE = "Incomplete Generation"
UNAVAILABLE = "Service Unavailable"
UNAUTHORIZED = "Unauthorized"
TOO_MANY_REQUESTS = "Too Many Requests"
CODE_TIMEOUT = 802
CODE_GENERATION = 9999
CODE_APIKEY = 801
CODE_NOT_AUTHORIZED = 702
PARSE_FAILED = "Failed to parse request context to json"


class EdgeError(Exception):
    """A failure answered with `status` and the merged error body."""

    def __init__(self, status: int, error_type: str, message: str, code: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.code = status if code is None else code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": self.message,
            "error_type": self.error_type,
            "code": self.code,
            "result": None,
            "message": self.message,
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_input(message: str) -> EdgeError:
    return EdgeError(422, INPUT_VALIDATION, message)


def body_too_large(limit_mib: int) -> EdgeError:
    message = f"Request body too large. Maximum allowed size is {limit_mib}MB."
    return EdgeError(413, TOO_LARGE, message)


def bad_http(reason: str) -> EdgeError:
    return EdgeError(400, "Bad Request", f"Invalid HTTP request: {reason}")


def head_too_large(message: str) -> EdgeError:
    return EdgeError(431, "Request Header Fields Too Large", message)


def read_timeout(part: str, timeout_s: float) -> EdgeError:
    """The request `part` ("head", "body") did not arrive in time; the connection
    cannot be reused (the rest of the request may still come), so it is closed."""
    message = f"Request {part} not received within {timeout_s:g} s"
    return EdgeError(408, "Request Timeout", message, headers={"Connection": "close"})


def unsupported_media_type(content_type: str | None) -> EdgeError:
    sent = f"got {content_type!r}" if content_type is not None else "none was sent"
    return EdgeError(415, "Unsupported Media Type", f"Content-Type must be application/json, {sent}")


def unauthorized(message: str) -> EdgeError:
    """No key (702) or an unknown one (801); the 401 names the scheme it wants (RFC 9110)."""
    code = CODE_NOT_AUTHORIZED if message == NOT_PASSED else CODE_APIKEY
    return EdgeError(401, UNAUTHORIZED, message, code, headers={"WWW-Authenticate": "Bearer"})


def unavailable(message: str) -> EdgeError:
    return EdgeError(503, UNAVAILABLE, message)


def request_timeout(timeout_s: float) -> EdgeError:
    """The request ran past `request_timeout_s` (MindIE's e2eTimeout)."""
    message = f"Request timeout: no complete reply within e2eTimeout ({timeout_s:g} s)"
    return EdgeError(500, INCOMPLETE, message, CODE_TIMEOUT)


_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, int | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (422, INPUT_VALIDATION, None),
    grpc.StatusCode.NOT_FOUND: (422, INPUT_VALIDATION, None),
    grpc.StatusCode.OUT_OF_RANGE: (424, GENERATION, CODE_GENERATION),
    grpc.StatusCode.UNAVAILABLE: (503, UNAVAILABLE, None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, UNAVAILABLE, None),
    grpc.StatusCode.DEADLINE_EXCEEDED: (500, INCOMPLETE, CODE_TIMEOUT),
    grpc.StatusCode.UNAUTHENTICATED: (401, UNAUTHORIZED, CODE_APIKEY),
    grpc.StatusCode.PERMISSION_DENIED: (401, UNAUTHORIZED, CODE_NOT_AUTHORIZED),
}


def from_grpc(code: grpc.StatusCode, details: str | None, reason: str = "",
              retry_after: int | None = None) -> EdgeError:
    """The answer to a gRPC status; `reason` is its ErrorInfo reason and
    `retry_after` its retry delay in seconds (services.common.errors)."""
    status, error_type, doc_code = _GRPC_TO_HTTP.get(code, (500, INCOMPLETE, CODE_GENERATION))
    message = client_message(code, details)
    headers = {}
    if code == grpc.StatusCode.INVALID_ARGUMENT and reason == PAYLOAD_TOO_LARGE:
        status, error_type = 413, TOO_LARGE
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == RATE_LIMITED:
        status, error_type, doc_code = 429, TOO_MANY_REQUESTS, 429
        headers["Retry-After"] = str(retry_after or 1)
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        return unauthorized(message)
    return EdgeError(status, error_type, message, doc_code, headers)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> EdgeError:
    trailers = exc.trailing_metadata()
    return from_grpc(exc.code(), exc.details(), error_reason(trailers), retry_after_s(trailers))


def from_chat_error(code: int, message: str, error_type: str) -> EdgeError:
    """A `ChatChunk.error` (failure after the stream started): HTTP 500 when not streaming."""
    return EdgeError(
        500, error_type or INCOMPLETE, message or "generation failed", code or CODE_GENERATION
    )


# -- FastAPI wiring ----------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, ours or the framework's, uses the merged body."""

    async def on_edge_error(request: Request, exc: EdgeError) -> JSONResponse:
        request.scope[ERROR_SCOPE_KEY] = exc  # for the metrics and the access log
        return exc.response()

    async def on_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in exc.errors()]  # drop "body"/"query"
        return invalid_input(describe_validation(errors)).response()

    async def on_http_exception(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        error_type = "NotFoundError" if exc.status_code == 404 else phrase
        message = exc.detail if isinstance(exc.detail, str) else phrase
        response = EdgeError(exc.status_code, error_type, message).response()
        response.headers.update(exc.headers or {})
        return response

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Answered outside ObserveMiddleware (Starlette's outermost layer), which has
        # logged the request by now: the id it gave goes into this line and the answer.
        record = record_of(request.scope)
        request_id = record.request_id if record is not None else None
        log.error("unhandled error in %s %s request_id=%s", request.method, request.url.path, request_id,
                  exc_info=exc, extra={"fields": {"request_id": request_id}})
        response = EdgeError(500, INCOMPLETE, INTERNAL_ERROR, CODE_GENERATION).response()
        if request_id is not None:
            response.headers["x-request-id"] = request_id
        return response

    app.add_exception_handler(EdgeError, on_edge_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
