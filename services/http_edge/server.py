"""Run the edge under uvicorn: one process, one event loop, one gRPC channel.

SIGTERM/SIGINT drain the edge (drain.py): it keeps listening, answers new
requests 503, and lets the requests in flight finish for up to
`drain_timeout_s`; those still running then end with the error body (a stream
with a final error frame and `[DONE]`). Then uvicorn stops (closing idle
connections, cutting what is left after FINAL_S), runs the app's shutdown
(closing the channel), and the process exits with status 0. A second signal
stops it at once, as uvicorn does.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import grpc
import uvicorn

from services.common.drain import Drain
from services.common.tls import InternalTls
from services.http_edge.app import create_app
from services.http_edge.backend import ChatBackend
from services.http_edge.config import EdgeConfig
from services.http_edge.http_protocol import EdgeHttpProtocol

log = logging.getLogger(__name__)
# After the drain: how long requests it ended get to send their error, and
# connections to close, before uvicorn cuts them.
FINAL_S = 1.0


def _exit_cleanly(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the app before it stops."""

    def __init__(self, config: uvicorn.Config, drain: Drain, backend: ChatBackend, drain_timeout_s: float):
        super().__init__(config)
        self.drain = drain
        self.backend = backend
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.drain.draining or self._drain_task is not None:
            super().handle_exit(sig, frame)  # before start-up, or a second signal: stop now
            return
        # A signal handler: hand over to the loop, which may be in the middle of anything.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    def _end_calls(self) -> None:
        ended = self.backend.abort_all(grpc.StatusCode.UNAVAILABLE, self.drain.expiry())
        log.warning("ended %d chat calls at the drain timeout", ended)

    async def _drain(self) -> None:
        try:
            await self.drain.run(self.drain_timeout_s, on_expiry=self._end_calls, final_s=FINAL_S)
        finally:
            self.should_exit = True


def build_server(config: EdgeConfig) -> DrainingServer:
    app = create_app(config)
    tls = InternalTls.of(config)
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            lifespan="on",
            # uvloop and httptools: per streamed token, h11's pure-Python framing and
            # asyncio's transport cost the edge about 10 % more CPU (measured at 32 streams).
            # The httptools protocol comes with the edge's header limits and read timeouts.
            loop="uvloop",
            http=EdgeHttpProtocol.for_config(config, app.state.metrics),
            log_config=None,  # keep services.common.log's format
            access_log=False,  # observe.py writes the one access line per request
            timeout_graceful_shutdown=FINAL_S,
            # Internal mutual TLS: HTTPS, and the protocol refuses a request without a client certificate.
            **(tls.edge_ssl_settings() if tls is not None else {}),
        ),
        app.state.drain, app.state.backend, config.drain_timeout_s,
    )


def run(config: EdgeConfig) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    log.info(
        "http_edge on %s:%d -> ChatService at %s%s", config.host, config.port, config.tokenizer_address,
        " (internal mutual TLS)" if config.internal_tls_ca_file else "",
    )
    build_server(config).run()
