"""uvicorn's httptools protocol with the limits a public endpoint needs.

Stock uvicorn buffers a request head of any size and any number of fields,
waits forever for a head that never ends (or a connection that never sends a
byte), and answers malformed HTTP in plain text. This subclass, per connection:

- refuses a head above `max_header_kib` or with more than `max_headers` fields
  with 431 while it is parsed: the check runs on every callback and after every
  read, so at most about one read (<= 256 KiB) beyond the limit is buffered;
- gives a head `header_timeout_s` to arrive, counted from connection open and,
  on a kept-alive connection, from the first byte after a response: a started
  head that is late gets 408, a connection that sent nothing is just closed
  (browsers open spare connections and would log a stray 408);
- answers malformed HTTP with 400;
- resets a connection whose client leaves its reply unread: when writing
  stays paused (the kernel's send buffer full, more waiting at the edge) for
  `stream_stall_timeout_s`, what is still unsent, in the edge and in the
  kernel, is dropped with the connection. A stream's app sees the disconnect
  and cancels its request; a whole (non-stream) reply, written in one piece
  and done with as far as the app knows, is freed with it.

With internal mutual TLS (services/common/tls.py) the connection is HTTPS and
a client certificate is optional at the TLS layer (one that is sent must be
from the internal CA): kubelet probes and Prometheus have none. A request on
a connection without one gets 403 unless it is for /health or /metrics, as
soon as its head is read (before any body is).

Every answer uses errors.py's body and closes the connection: the parser is
mid-request and the rest of that request cannot be told from the next one.
The body's own timeout is `read_body`'s (serving.py), where the body is read.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any, ClassVar, Literal

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from services.http_edge.config import EdgeConfig
from services.http_edge.errors import EdgeError, bad_http, head_too_large, read_timeout
from services.http_edge.metrics import EdgeMetrics
from services.http_edge.observe import record_of

log = logging.getLogger(__name__)

FIELD_OVERHEAD = len(": \r\n")
# After a refusal the client may still be sending (a 1 MiB header): closing with
# its bytes unread makes the kernel send RST, which can destroy our answer before
# the client reads it. So the write side is shut and input discarded this long.
LINGER_S = 2.0
# Linux grows a connection's send buffer up to 4 MiB (tcp_wmem): a client that
# stops reading would park that much of its reply in the kernel before the
# transport paused writing and the stall timer could see it fall behind.
SEND_BUFFER_BYTES = 256 * 1024
# What a caller without a client certificate may ask for when internal TLS is on.
OPEN_PATHS = frozenset({b"/health", b"/metrics"})


def certificate_required() -> EdgeError:
    return EdgeError(403, "Forbidden", "A client certificate from the internal CA is required "
                                       "(internal TLS); only /health and /metrics answer without one.")


class EdgeHttpProtocol(HttpToolsProtocol):
    """Built per connection by uvicorn; `limits` and `metrics` are bound by `for_config`."""

    limits: ClassVar[EdgeConfig]
    metrics: ClassVar[EdgeMetrics | None] = None
    needs_certificate: ClassVar[bool] = False  # internal TLS: API routes need a client certificate

    @classmethod
    def for_config(cls, config: EdgeConfig, metrics: EdgeMetrics | None = None) -> type[EdgeHttpProtocol]:
        """A subclass bound to `config` and the app's metrics (which count its
        refusals): uvicorn builds protocols from a class and its own Config, so
        they travel as class attributes."""
        return type(cls.__name__, (cls,), {"limits": config, "metrics": metrics,
                                           "needs_certificate": bool(config.internal_tls_ca_file)})

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._phase: Literal["idle", "head", "body"] = "idle"
        self._head_bytes = 0  # this head's URL and fields, as the callbacks see them
        self._head_read = 0  # bytes read while this head was unfinished (see data_received)
        self._head_fields = 0
        self._message_ended = False  # a message ended in the read being parsed
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._refusal: EdgeError | None = None  # raised out of a parser callback
        self._lingering = False  # refused: input is read and dropped until the close
        self._has_certificate = False  # the TLS peer sent a certificate (verified against the CA)

    # -- connection events ----------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # The handshake is over: a certificate the CA did not sign has already failed it.
        ssl_object = transport.get_extra_info("ssl_object")
        self._has_certificate = ssl_object is not None and ssl_object.getpeercert(binary_form=True) is not None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_stall_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        self._unset_keepalive_if_required()
        if self._phase == "idle":
            self._arm_head_timer()  # bytes between requests (even bare CRLFs) start the clock
        self._message_ended = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # as uvicorn: WebSocket or a warning
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or bad_http(str(exc)))
            return
        # llhttp keeps a partial field or URL in its own buffer, out of the
        # callbacks' sight. A read that leaves the head unfinished, with no
        # message ending in it, was all head: count it so that a never-ending
        # field is refused after the limit, not after the whole field arrived.
        if self._phase == "head" and not self._message_ended:
            self._head_read += len(data)
            if self._head_read > self.limits.max_header_bytes:
                self._refuse(self._head_too_large())

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._phase == "head":  # a pipelined head that started during the response
            self._arm_head_timer()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.stream_stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._cancel_stall_timer()
        super().resume_writing()

    # -- parser callbacks -----------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = "head"
        self._head_bytes = self._head_read = self._head_fields = 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > self.limits.max_headers:
            self._raise(head_too_large(f"Request has more than {self.limits.max_headers} header fields"))
        self._count_head(len(name) + len(value) + FIELD_OVERHEAD)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._phase = "body"
        self._cancel_head_timer()
        if self.needs_certificate and not self._has_certificate and not self._is_open_path():
            self._raise(certificate_required())
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = "idle"
        self._message_ended = True
        super().on_message_complete()

    # -- limits ---------------------------------------------------------------

    def _head_too_large(self) -> EdgeError:
        return head_too_large(f"Request header fields exceed {self.limits.max_header_kib} KiB")

    def _count_head(self, size: int) -> None:
        """Head bytes the callbacks see in full; exact where a whole head came in one read."""
        self._head_bytes += size
        if self._head_bytes > self.limits.max_header_bytes:
            self._raise(self._head_too_large())

    def _raise(self, error: EdgeError) -> None:
        """Stop the parser from a callback: httptools turns any exception into
        HttpParserCallbackError, so the refusal itself waits in `_refusal`."""
        self._refusal = error
        raise error

    def _is_open_path(self) -> bool:
        try:
            return httptools.parse_url(self.url).path in OPEN_PATHS
        except httptools.HttpParserInvalidURLError:
            return False

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"

    def _in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        # Not while a response is being written: a client may send a stray CRLF
        # after its body (RFC 9112 §2.2) and must not lose a long stream for it.
        if self._head_timer is None and not self._in_flight():
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        # The timer is cancelled once a head is complete, so the phase is "idle" or "head".
        self._head_timer = None
        if self._phase == "head":
            self._refuse(read_timeout("head", self.limits.header_timeout_s))
        else:  # nothing of a request came, at most the CRLFs allowed between requests
            self.transport.close()

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        record = record_of(self.cycle.scope) if self.cycle is not None else None
        log.warning("%s: the client took too little of its reply for %g s; connection dropped",
                    record.request_id if record is not None else self._peer(), self.limits.stream_stall_timeout_s)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset: a plain close would leave the kernel delivering its buffer for minutes
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _refuse(self, error: EdgeError) -> None:
        """Answer `error` with the merged body and close the connection."""
        self._cancel_head_timer()
        if self._lingering or self.transport.is_closing():
            return
        log.info("refused %s: %d %s", self._peer(), error.status, error.message)
        if self.metrics is not None:
            self.metrics.record_refusal(error)
        if self._in_flight():
            # A pipelined request failed while an earlier response is being
            # written: an answer now would corrupt that response.
            self.transport.close()
            return
        response = error.response()
        headers = [*self.server_state.default_headers,
                   *((name, value) for name, value in response.raw_headers if name != b"connection"),
                   (b"connection", b"close")]
        head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(STATUS_LINE[error.status] + head + b"\r\n" + response.body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # The client sees the answer and the end of the stream at once; its EOF
        # (eof_received) or the timer closes the transport.
        self._lingering = True
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)
