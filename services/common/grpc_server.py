"""One way to run a gRPC service: grpc.aio with the standard health service
(NOT_SERVING until the service says it is ready), reflection, the error
interceptor, and a graceful drain on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ErrorInterceptor

log = logging.getLogger(__name__)

# Generation streams can be long; let large prompts and step batches through.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class GrpcService:
    """A grpc.aio server with health and reflection; `serve_forever` drains on signals."""

    def __init__(self, name: str, host: str, port: int, grace_s: float = 5.0):
        self.name = name
        self.grace_s = grace_s
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self._stop = asyncio.Event()

    def add(self, register: Callable[[Any, grpc.aio.Server], None], servicer: Any, descriptor) -> None:
        """Register a servicer; `descriptor` is the pb2 ServiceDescriptor."""
        register(servicer, self.server)
        self._service_names.append(descriptor.full_name)

    async def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        await self.set_serving(False)
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        log.info("%s listening on port %d", self.name, self.port)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self._service_names):
            await self.health.set(name, status)

    async def serve_forever(self) -> None:
        """Wait for SIGTERM/SIGINT, then stop accepting work and drain for `grace_s`."""
        await self._stop.wait()
        log.info("%s shutting down", self.name)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_s)


def channel(address: str) -> grpc.aio.Channel:
    """A client channel with the same message limits as the servers."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def is_serving(chan: grpc.aio.Channel, timeout_s: float = 2.0) -> bool:
    """True when the peer's health service answers SERVING."""
    stub = health_pb2_grpc.HealthStub(chan)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
