"""The edge's one gRPC channel to ChatService (the tokenizer), and a short-lived
cache of its ListModels answer for `/v1/models` and the request model check."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import grpc
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.grpc_server import channel, is_serving
from services.common.multiplex_client import CallMultiplexer, MultiplexedCall
from services.common.tls import InternalTls
from services.http_edge.errors import from_rpc_error, invalid_input, unavailable

LIST_MODELS_TIMEOUT_S = 5.0


class ChatBackend:
    """ChatService client: every Chat call of this process on one ChatStream.
    The channel is opened on first use, inside the server's event loop
    (grpc.aio channels belong to one loop)."""

    def __init__(
        self,
        address: str,
        models_cache_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        tls: InternalTls | None = None,
    ):
        self.address = address
        self.tls = tls
        self.models_cache_s = models_cache_s
        self._clock = clock
        self._channel: grpc.aio.Channel | None = None
        self._stub: chat_pb2_grpc.ChatServiceStub | None = None
        self._calls: CallMultiplexer | None = None
        self._models: list[chat_pb2.Model] = []
        self._models_at: float | None = None
        self._models_lock: asyncio.Lock | None = None

    def _chat_stub(self) -> chat_pb2_grpc.ChatServiceStub:
        if self._stub is None:
            self._channel = channel(self.address, self.tls)
            self._stub = chat_pb2_grpc.ChatServiceStub(self._channel)
            self._calls = CallMultiplexer(self._stub.ChatStream, chat_pb2.ChatStreamRequest)
            self._models_lock = asyncio.Lock()
        return self._stub

    def chat(self, request: chat_pb2.ChatRequest, timeout_s: float | None,
             max_buffered_bytes: int | None = None, metadata: Mapping[str, str] | None = None) -> MultiplexedCall:
        """Start a Chat call with the client's `metadata` (its credential); the
        caller reads the chunks and cancels on disconnect."""
        self._chat_stub()
        assert self._calls is not None
        return self._calls.start(request, timeout_s, max_buffered_bytes, metadata)

    async def list_models(self, metadata: Mapping[str, str] | None = None) -> list[chat_pb2.Model]:
        """The served models, at most `models_cache_s` old; a call made for one
        client serves the others too (each was let in by the edge's own key
        check). Raises AioRpcError."""
        stub = self._chat_stub()
        assert self._models_lock is not None
        async with self._models_lock:
            now = self._clock()
            if self._models_at is None or now - self._models_at >= self.models_cache_s:
                reply = await stub.ListModels(chat_pb2.ListModelsRequest(), timeout=LIST_MODELS_TIMEOUT_S,
                                              metadata=tuple((metadata or {}).items()))
                self._models, self._models_at = list(reply.models), now
            return self._models

    async def served_models(self, metadata: Mapping[str, str] | None = None) -> list[chat_pb2.Model]:
        """`list_models` with failures as EdgeErrors: 503 when the backend is down
        or too slow to answer (that is not a generation timeout), else mapped."""
        try:
            return await self.list_models(metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                message = f"ChatService did not list its models within {LIST_MODELS_TIMEOUT_S:g} s"
                raise unavailable(message) from exc
            raise from_rpc_error(exc) from exc

    async def require_model(self, name: str, metadata: Mapping[str, str] | None = None) -> chat_pb2.Model:
        """The served model called `name`; 422 "Model not found" otherwise."""
        for model in await self.served_models(metadata):
            if model.id == name:
                return model
        raise invalid_input("Model not found")

    def abort_all(self, code: grpc.StatusCode, details: str) -> int:
        """End every running Chat call: its reader gets `code` and `details`."""
        return self._calls.abort_all(code, details) if self._calls is not None else 0

    async def is_serving(self) -> bool:
        self._chat_stub()
        assert self._channel is not None
        return await is_serving(self._channel)

    async def close(self) -> None:
        if self._calls is not None:
            await self._calls.close()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = self._calls = None
