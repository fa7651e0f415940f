"""One way to run a gRPC service: grpc.aio with the standard health service
(NOT_SERVING until the service says it is ready), reflection, the error
interceptor, and a graceful drain on SIGTERM/SIGINT (services/common/drain.py).

On the signal the health service turns NOT_SERVING for good (it keeps
answering: a caller can tell a draining service from a dead one), new work is
refused with UNAVAILABLE by the servicers (through `drain`), running calls go
on until they are done or `drain_timeout_s` ends them with an error, and then
the server stops.

With internal TLS (services/common/tls.py) the port takes only clients with a
certificate from the internal CA, and `health_port` opens a second, plaintext
port that serves the same health service and nothing else: Kubernetes' gRPC
probes cannot present a certificate."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain
from services.common.errors import ErrorInterceptor
from services.common.tls import InternalTls

log = logging.getLogger(__name__)

# Generation streams can be long; let large prompts and step batches through.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# After the drain: how long calls it ended get to send their final status.
FINAL_STATUS_S = 1.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class GrpcService:
    """A grpc.aio server with health and reflection; `serve_forever` drains on signals."""

    def __init__(self, name: str, host: str, port: int, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                 tls: InternalTls | None = None, health_port: int = 0):
        self.name = name
        self.drain_timeout_s = drain_timeout_s
        self.drain = Drain(name)
        self.server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, tls.server_credentials())
        # The health-only server shares the servicer: the same statuses, the same drain.
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        if health_port:
            self.health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
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
        if self.health_server is not None:
            await self.health_server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        log.info("%s listening on port %d%s", self.name, self.port,
                 "" if self.health_port is None else f" (health only, plaintext: port {self.health_port})")

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self._service_names):
            await self.health.set(name, status)

    def request_stop(self) -> None:
        """What SIGTERM/SIGINT do: `serve_forever` drains and returns."""
        self._stop.set()

    async def serve_forever(self, is_idle: Callable[[], bool] | None = None, settle_s: float = 0.0,
                            stop_listening: bool = False) -> bool:
        """Wait for SIGTERM/SIGINT, then drain: NOT_SERVING, no new work, running
        calls finish (and `is_idle()` holds for `settle_s`) within `drain_timeout_s`,
        else they end with an error. True when nothing had to be ended.

        `stop_listening`: close the port and send GOAWAY at once, so that callers
        reconnect (to another replica) for new calls while the running ones go
        on; health then no longer answers. Only for a service whose running calls
        need no new RPC from their callers (the scheduler's need Abort, and the
        scheduler must see a draining worker answer NOT_SERVING)."""
        await self._stop.wait()
        log.info("%s shutting down", self.name)
        await self.health.enter_graceful_shutdown()
        refusing = None
        if stop_listening:  # grpc's shutdown: no new RPCs, the running ones go on
            refusing = asyncio.create_task(self.server.stop(self.drain_timeout_s + 2 * FINAL_STATUS_S))
        drained = await self.drain.run(self.drain_timeout_s, is_idle, settle_s, final_s=FINAL_STATUS_S)
        # Calls still open now are idle streams (health watches): they get a moment, then are cut.
        await self.server.stop(FINAL_STATUS_S)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if refusing is not None:
            refusing.cancel()
            await asyncio.gather(refusing, return_exceptions=True)
        return drained


def channel(address: str, tls: InternalTls | None = None) -> grpc.aio.Channel:
    """A client channel with the same message limits as the servers; with `tls`,
    over mutual TLS (it presents its certificate and checks the server's)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS + tls.channel_options())


async def health_status(chan: grpc.aio.Channel, timeout_s: float = 2.0) -> int | None:
    """The peer's HealthCheckResponse.ServingStatus, or None when it does not answer."""
    stub = health_pb2_grpc.HealthStub(chan)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return None
    return reply.status


async def is_serving(chan: grpc.aio.Channel, timeout_s: float = 2.0) -> bool:
    """True when the peer's health service answers SERVING."""
    return await health_status(chan, timeout_s) == health_pb2.HealthCheckResponse.SERVING
