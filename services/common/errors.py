"""Errors that carry a gRPC status, the one interceptor that turns them
(and anything unexpected) into a real status for the caller, and what of a
status a client may read."""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

log = logging.getLogger(__name__)
# A google.rpc.Status code as the grpc library names it.
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class ServiceError(Exception):
    """Raised by domain code; the interceptor answers with `code` and the message,
    and with `error_reason` (when set) as a google.rpc.ErrorInfo in the status
    details, for a caller that must tell apart refusals of one code, and with
    `retry_after_s` (when set) as a google.rpc.RetryInfo and a `retry-after`
    trailer (HTTP's Retry-After once transcoded)."""

    def __init__(self, code: grpc.StatusCode, message: str, error_reason: str = "",
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.error_reason = error_reason
        self.retry_after_s = retry_after_s


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


INTERNAL_ERROR = "internal error"

# The rich status (google.rpc.Status with an ErrorInfo of this domain) rides in
# this trailer of a plain RPC and is the `end` of a multiplexed call.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
ERROR_DOMAIN = "stormserve"
# ErrorInfo reasons. An INVALID_ARGUMENT whose input is larger than allowed (HTTP 413).
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
# A RESOURCE_EXHAUSTED for an API key's own limit, not the server's load (HTTP 429).
RATE_LIMITED = "RATE_LIMITED"
RETRY_AFTER_KEY = "retry-after"

# Codes our services raise on purpose with a message written for the client
# (the prompt is too long, the model is unknown, the queue is full...).
CLIENT_CODES = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
})

# What a client reads for any other status, and for a status of the codes
# above that the gRPC library wrote: its details name peers' addresses and
# transport errors, and ours name workers and exceptions, all for the logs.
FIXED_MESSAGES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid request",
    grpc.StatusCode.NOT_FOUND: "not found",
    grpc.StatusCode.OUT_OF_RANGE: "the request is out of range",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the service is overloaded, retry later",
    grpc.StatusCode.ALREADY_EXISTS: "the request is already running",
    grpc.StatusCode.FAILED_PRECONDITION: "the request cannot be served",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission denied",
    grpc.StatusCode.UNAVAILABLE: "the service is temporarily unavailable, retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.ABORTED: "the request was aborted, retry",
    grpc.StatusCode.UNIMPLEMENTED: "not supported by this server",
}

# The scheduler's own UNAVAILABLE messages: written for clients and free of
# addresses, so they are shown where the library's UNAVAILABLE details are not.
WORKER_LOST = "the worker running this request was lost"
NO_WORKER_READY = "no worker is ready"
# A step the worker refused whole (a scheduler fault, not this request's): the
# requests in it end; the worker stays in service.
STEP_FAILED = "a step running this request failed on the worker"
# A fault of the scheduler's own step loop: the requests on that worker end; the loop starts afresh.
STEP_LOOP_FAILED = "the scheduler failed a step running this request"
CLIENT_UNAVAILABLE_MESSAGES = frozenset({WORKER_LOST, NO_WORKER_READY, STEP_FAILED, STEP_LOOP_FAILED})
# A draining service's own words (drain.py): a new call refused, a running one
# ended by the drain timeout. They name the service, never an address. A refused
# call never started, so a client may send it again elsewhere (multiplex_client.py does).
DRAIN_REFUSED = "is shutting down and takes no new requests"


def drain_refused(service: str) -> str:
    return f"{service} {DRAIN_REFUSED}"


def drain_expired(service: str, timeout_s: float) -> str:
    return f"{service} shut down before this request finished: its drain timeout ({timeout_s:g} s) passed"


_DRAIN_MESSAGE = re.compile(
    rf"[a-z_]+ (?:{DRAIN_REFUSED}|shut down before this request finished: its drain timeout \([0-9.e+]+ s\) passed)")

# Details only the gRPC library writes: a peer's address (ipv4:1.2.3.4:5,
# ipv6:[::1]:5, unix:/path, host:port) or its message size limits.
_LIBRARY_DETAILS = re.compile(
    r"\b(?:ipv[46]|unix|dns):|\b\d{1,3}(?:\.\d{1,3}){3}:\d+|\[[0-9a-f:.]*\]:\d+|\blocalhost:\d+"
    r"|message larger than max|failed to connect", re.IGNORECASE)


def client_message(code: grpc.StatusCode, details: str | None) -> str:
    """What a client may read of a status: our own message for the codes we raise
    for clients, else a fixed message for the code. Log `details` beside it."""
    if code in CLIENT_CODES and details and not _LIBRARY_DETAILS.search(details):
        return details
    if code == grpc.StatusCode.UNAVAILABLE and details and (
            details in CLIENT_UNAVAILABLE_MESSAGES or _DRAIN_MESSAGE.fullmatch(details)):
        return details
    return FIXED_MESSAGES.get(code, INTERNAL_ERROR)


def status_of(exc: BaseException, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception ends its call with. An unexpected one is
    logged, with the request's id, and answered INTERNAL without its text."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    log.exception("unhandled error in handler%s", f" for {request_id}" if request_id else "", exc_info=exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_ERROR


def status_proto(exc: BaseException, request_id: str = "") -> status_pb2.Status:
    """`status_of` as a google.rpc.Status, with the ErrorInfo of a ServiceError's reason."""
    code, message = status_of(exc, request_id)
    status = status_pb2.Status(code=code.value[0], message=message)
    if isinstance(exc, ServiceError) and exc.error_reason:
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=exc.error_reason, domain=ERROR_DOMAIN))
    if isinstance(exc, ServiceError) and exc.retry_after_s is not None:
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay={"seconds": exc.retry_after_s}))
    return status


def status_trailers(status: status_pb2.Status) -> tuple[tuple[str, bytes | str], ...]:
    """The trailing metadata that carries `status`'s details (none without
    details), and its RetryInfo's delay as `retry-after` seconds."""
    if not status.details:
        return ()
    trailers: list[tuple[str, bytes | str]] = [(STATUS_DETAILS_KEY, status.SerializeToString())]
    retry = error_details_pb2.RetryInfo()
    if any(detail.Unpack(retry) for detail in status.details):
        trailers.append((RETRY_AFTER_KEY, str(retry.retry_delay.seconds)))
    return tuple(trailers)


def retry_after_s(trailing_metadata: Any) -> int | None:
    """The `retry-after` seconds a status carries, None if none."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_KEY and isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def error_reason(trailing_metadata: Any) -> str:
    """The ErrorInfo reason of our domain in a call's status details, "" if none."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        for detail in status_pb2.Status.FromString(value).details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
                return info.reason
    return ""


def request_id_of(request: Any) -> str:
    """The `request_id` of a Chat or Generate request, "" for anything else."""
    request_id = getattr(request, "request_id", "")
    return request_id if isinstance(request_id, str) else ""


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, request: Any) -> None:
    status = status_proto(exc, request_id_of(request))
    await context.abort(STATUS_CODES[status.code], status.message, status_trailers(status))


def _wrap_unary(fn: Callable[[Any, Any], Awaitable[Any]]):
    async def wrapper(request, context):
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the point of the interceptor
            await _abort(context, exc, request)

    return wrapper


def _wrap_stream(fn: Callable[[Any, Any], AsyncIterator[Any]]):
    async def wrapper(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, request)

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ServiceError to its status and any other exception to INTERNAL."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
