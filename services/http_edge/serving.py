"""`POST /v1/chat/completions`: read and validate the body, check the model,
start a Chat call (on the backend's ChatStream), and answer with one JSON object or an SSE stream.

Check order follows the reference: body size -> JSON parse -> fields -> model,
after a Content-Type check (415) that runs before any byte of the body is read.
A gRPC error before the first chunk becomes an HTTP error (also when
`stream` is true); after the stream started it becomes a final `data:` frame
holding the error body and a `finish_reason`, then `data: [DONE]`.

`request_timeout_s` (e2eTimeout) counts from arrival and becomes the deadline
of the Chat call: when it passes, the call is cancelled, which cancels the
tokenizer's handler and through it the scheduler's sequence. The client gets
code 802 (HTTP 500, or a final frame once the stream has started).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from stormserve.chat.v1 import chat_pb2

from services.common.chat_protocol import ChatCompletionRequest
from services.common.multiplex_client import MultiplexedCall
from services.common.validation import describe_validation, field_path
from services.http_edge.auth import credential_metadata
from services.http_edge.backend import ChatBackend
from services.http_edge.config import EdgeConfig
from services.http_edge.convert import now_us, to_chat_request
from services.http_edge.errors import (
    PARSE_FAILED,
    EdgeError,
    body_too_large,
    from_chat_error,
    from_rpc_error,
    invalid_input,
    read_timeout,
    request_timeout,
    unsupported_media_type,
)
from services.http_edge.observe import RequestRecord, record_of
from services.http_edge.render import CompletionBuilder, ReplyContext, chunk_json, finish_reason
from services.http_edge.streaming import (
    DONE,
    ClientGone,
    EventStreamResponse,
    sse_event,
    unless_disconnected,
)

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32  # MindIE drops subtrees deeper than 10; we refuse absurd nesting instead
_DOUBLE_MAX = int(sys.float_info.max)
DEADLINE_SLACK_S = 0.05
CLIENT_CLOSED = 499  # nobody reads it; the status only shows up in access logs


async def read_body(request: Request, limit_bytes: int, limit_mib: int, timeout_s: float) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed the limit,
    and with 408 when it has not fully arrived `timeout_s` after reading began:
    a client that declares a body and stalls would otherwise hold the request
    (and its connection) until the e2e timeout, or for ever when that is off."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise body_too_large(limit_mib)
    pieces, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                size += len(piece)
                if size > limit_bytes:
                    raise body_too_large(limit_mib)
                pieces.append(piece)
    except TimeoutError:
        raise read_timeout("body", timeout_s) from None
    return b"".join(pieces)


def require_json(request: Request) -> None:
    """415 unless the body is declared `application/json` (any parameters, any
    case). A browser page may POST a type-less Blob, text/plain or a form to any
    origin without a CORS preflight; requiring the JSON type closes that door."""
    content_type = request.headers.get("content-type")
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise unsupported_media_type(content_type)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _JsonObject(dict):
    """A parsed JSON object that remembers the first key it saw twice: the
    decoder would keep the last value silently, and which one the client meant
    is anybody's guess."""

    __slots__ = ("duplicate",)

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        self.duplicate: str | None = None
        if len(self) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.duplicate = key
                    break
                seen.add(key)


def _is_unicode(text: str) -> bool:
    """False for a lone surrogate (`"\\ud800"` is a valid JSON escape but no character):
    protobuf, the tokenizer and our own JSON replies cannot encode it."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(key: str, limit: int = 64) -> str:
    """A client's key for an error message: JSON-quoted, escaped, cut short."""
    quoted = json.dumps(key[:limit])
    return quoted if len(key) <= limit else quoted[:-1] + '..."'


def _check_tree(data: dict[str, Any]) -> None:
    """One walk of the parsed body for what the models cannot see: nesting depth,
    duplicate keys, strings (keys included) that are not valid Unicode, and
    integers no double can hold (`1e400` already parses as a float infinity).
    A failure names the field path, as validation errors do."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        node, loc = stack.pop()
        if len(loc) >= MAX_JSON_DEPTH:
            raise invalid_input(f"{PARSE_FAILED}: nesting deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            for key in node:
                if not _is_unicode(key):
                    where = field_path(loc) or "the body"
                    raise invalid_input(f"{where} has a key that is not valid Unicode (a lone surrogate)")
            if getattr(node, "duplicate", None) is not None:
                where = field_path(loc) or "the body"
                raise invalid_input(f"duplicate key {_shown(node.duplicate)} in {where}")
            children = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        for name, child in children:
            if isinstance(child, str):
                if not _is_unicode(child):
                    raise invalid_input(f"{field_path((*loc, name))} is not valid Unicode (a lone surrogate)")
            elif isinstance(child, (dict, list)):
                stack.append((child, (*loc, name)))
            elif type(child) is int and not -_DOUBLE_MAX <= child <= _DOUBLE_MAX:
                # Free-form objects travel as protobuf Structs, whose numbers are doubles.
                raise invalid_input(f"{field_path((*loc, name))} is out of range: a number must fit a double")


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Body bytes -> a validated request; every failure is a 422 with the merged body."""
    try:
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_JsonObject)
    except UnicodeDecodeError:
        raise invalid_input(f"{PARSE_FAILED}: the body is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise invalid_input(f"{PARSE_FAILED}: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_input(f"{PARSE_FAILED}: the body must be a JSON object")
    _check_tree(data)
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid_input(describe_validation(exc.errors(include_url=False))) from None


async def next_chunk(call: MultiplexedCall) -> chat_pb2.ChatChunk | None:
    """The next chunk, or None at the end of the stream. Raises AioRpcError."""
    response = await call.read()
    if response is grpc.aio.EOF:
        return None
    return response.chunk


def _chunk_error(chunk: chat_pb2.ChatChunk) -> EdgeError:
    return from_chat_error(chunk.error.code, chunk.error.message, chunk.error.error_type)


def _has_output(chunk: chat_pb2.ChatChunk) -> bool:
    return any(
        c.delta.content or c.delta.HasField("reasoning_content") or c.delta.tool_calls
        for c in chunk.choices
    )


def _output_only(chunk: chat_pb2.ChatChunk) -> chat_pb2.ChatChunk:
    """The text a failing chunk still carries (held-back stop-string text), as
    an ordinary chunk; the error frame after it carries the finish_reason."""
    partial = chat_pb2.ChatChunk()
    partial.CopyFrom(chunk)
    for name in ("error", "usage", "full_text", "prefill_time"):
        partial.ClearField(name)
    for choice in partial.choices:
        choice.finish_reason = chat_pb2.FINISH_REASON_UNSPECIFIED
    return partial


class Deadline:
    """The request's e2e deadline on the monotonic clock; None = no limit."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        if self.at is None:
            return None
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise request_timeout(self.timeout_s)
        return remaining

    def rpc_error(self, exc: grpc.aio.AioRpcError) -> EdgeError:
        """Our own deadline passing reads as the documented timeout; any other status is mapped."""
        # The call's deadline was fixed a moment after `at`; the slack only absorbs clock rounding.
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.at is not None \
                and time.monotonic() >= self.at - DEADLINE_SLACK_S:
            return request_timeout(self.timeout_s)
        return from_rpc_error(exc)


def error_frame(error: EdgeError, chunk: chat_pb2.ChatChunk | None = None) -> bytes:
    """The last SSE event of a stream that failed after it started."""
    reasons = [finish_reason(c.finish_reason) for c in chunk.choices] if chunk is not None else []
    return sse_event({**error.body(), "finish_reason": next((r for r in reasons if r), "stop")})


class ChatCompletions:
    """The handler of `POST /v1/chat/completions`."""

    def __init__(self, config: EdgeConfig, backend: ChatBackend):
        self.config = config
        self.backend = backend

    async def __call__(self, request: Request) -> Response:
        arrival_us = now_us()
        deadline = Deadline(self.config.request_timeout_s)
        require_json(request)
        try:
            body = await read_body(request, self.config.max_request_bytes, self.config.max_request_mib,
                                   self.config.body_timeout_s)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED)
        chat = parse_chat_request(body)
        credential = credential_metadata(request)
        model = await self.backend.require_model(chat.model, credential)
        record = record_of(request.scope) or RequestRecord("", time.monotonic())
        record.model = chat.model
        grpc_request = to_chat_request(chat, request_id=record.request_id or None, arrival_time_us=arrival_us)
        ctx = ReplyContext(
            request_id=grpc_request.request_id,
            model=chat.model,
            created=arrival_us // 1_000_000,
            include_logprobs=chat.wants_logprobs,
            null_usage=chat.stream and chat.include_usage is True,
            system_fingerprint=model.system_fingerprint,
        )
        # A stream is read as fast as the client takes it: bound what waits for a slow reader.
        buffer_bytes = self.config.stream_buffer_kib * 1024 if chat.stream else None
        call = self.backend.chat(grpc_request, deadline.remaining_s(), buffer_bytes, credential)
        handed_off = False
        try:
            if chat.stream:
                first = await unless_disconnected(request.receive, next_chunk(call))
                if first is not None and first.HasField("error"):
                    raise _chunk_error(first)
                handed_off = True
                return EventStreamResponse(self._events(call, first, ctx, deadline, record), on_close=call.cancel)
            builder = CompletionBuilder(ctx)
            await unless_disconnected(request.receive, self._collect(call, builder, record))
            return JSONResponse(builder.result())
        except grpc.aio.AioRpcError as exc:
            error = deadline.rpc_error(exc)
            if error.status >= 500:
                log.warning("%s failed: %s %s", ctx.request_id, exc.code().name, exc.details())
            raise error from None
        except ClientGone:
            log.info("client left before %s was answered; cancelled", ctx.request_id)
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not handed_off:
                call.cancel()

    async def _collect(self, call: MultiplexedCall, builder: CompletionBuilder, record: RequestRecord) -> None:
        while (chunk := await next_chunk(call)) is not None:
            if chunk.HasField("error"):
                raise _chunk_error(chunk)
            record.note(chunk)
            builder.add(chunk)

    async def _events(
        self, call: MultiplexedCall, chunk: chat_pb2.ChatChunk | None, ctx: ReplyContext,
        deadline: Deadline, record: RequestRecord,
    ) -> AsyncIterator[bytes]:
        try:
            while chunk is not None:
                record.note(chunk)
                if chunk.HasField("error"):
                    if _has_output(chunk):
                        yield sse_event(chunk_json(_output_only(chunk), ctx))
                    yield error_frame(_chunk_error(chunk), chunk)
                    break
                yield sse_event(chunk_json(chunk, ctx))
                chunk = await next_chunk(call)
        except grpc.aio.AioRpcError as exc:
            log.warning("%s failed mid-stream: %s %s", ctx.request_id, exc.code().name, exc.details())
            yield error_frame(deadline.rpc_error(exc))
        yield DONE
