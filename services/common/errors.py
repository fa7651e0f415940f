"""Errors that carry a gRPC status, and the one interceptor that turns them
(and anything unexpected) into a real status for the caller."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """Raised by domain code; the interceptor answers with `code` and the message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a handler's exception ends its call with (logged when unexpected)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    log.exception("unhandled error in handler", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    await context.abort(*status_of(exc))


def _wrap_unary(fn: Callable[[Any, Any], Awaitable[Any]]):
    async def wrapper(request, context):
        try:
            return await fn(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - the point of the interceptor
            await _abort(context, exc)

    return wrapper


def _wrap_stream(fn: Callable[[Any, Any], AsyncIterator[Any]]):
    async def wrapper(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)

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
