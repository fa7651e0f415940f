"""The edge's one typed config: CLI flags and STORMSERVE_* environment
variables, with the MindIE names (`maxRequestLength`, `e2eTimeout`) as aliases."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.api_keys import ApiKeySettings, check_api_keys
from services.common.config import require, setting
from services.common.drain import check_drain_timeout, drain_timeout_setting
from services.common.tls import InternalTlsSettings, check_internal_tls

MAX_E2E_TIMEOUT_S = 65535  # MindIE's e2eTimeout range is [1, 65535] s
MAX_HEADER_KIB = 1024  # a head above 1 MiB is no API request; also bounds what a client makes us buffer
MAX_HEADERS = 10_000


@dataclass(frozen=True)
class EdgeConfig(ApiKeySettings, InternalTlsSettings):
    """HTTP edge: REST/SSE in front of ChatService."""

    host: str = setting("127.0.0.1", "address the HTTP server binds")
    port: int = setting(8000, "HTTP port (0 picks a free one)")
    tokenizer_address: str = setting(
        "127.0.0.1:50051", "host:port of the ChatService (tokenizer) gRPC server"
    )
    max_request_mib: int = setting(
        40, "largest accepted request body in MiB, [1, 100]; larger bodies get 413",
        alias="maxRequestLength",
    )
    request_timeout_s: float | None = setting(
        600.0,
        "end-to-end deadline of one chat request in seconds, (0, 65535]; empty means none",
        alias="e2eTimeout",
    )
    models_cache_s: float = setting(
        5.0, "how long a ListModels answer is reused for /v1/models and model checks, >= 0"
    )
    stream_buffer_kib: int = setting(
        256, "most of a stream's reply (serialized KiB) the edge holds for a client that reads slower than "
        "it is generated, [16, 65536]; past it the request is cancelled")
    stream_stall_timeout_s: float = setting(
        30.0, "seconds a client may leave its reply (a stream or a whole one) unread, its connection's buffers "
        "full, before the connection is reset and a stream's request cancelled, (0, 3600]")
    drain_timeout_s: float = drain_timeout_setting()
    max_header_kib: int = setting(
        32, f"largest request head (request line and header fields) in KiB, [1, {MAX_HEADER_KIB}]; "
        "larger gets 431"
    )
    max_headers: int = setting(
        100, f"most header fields in one request, [1, {MAX_HEADERS}]; more gets 431"
    )
    header_timeout_s: float = setting(
        10.0, "seconds a request head may take to arrive, from connection open or its first "
        f"byte, (0, {MAX_E2E_TIMEOUT_S}]; past it 408 and the connection is closed"
    )
    body_timeout_s: float = setting(
        30.0, f"seconds a chat request body may take to arrive, (0, {MAX_E2E_TIMEOUT_S}]; "
        "past it 408 and the connection is closed"
    )

    def __post_init__(self) -> None:
        require(bool(self.host), "host must not be empty")
        require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        host, sep, port = self.tokenizer_address.rpartition(":")
        require(
            bool(sep and host and port.isdigit()),
            f"tokenizer_address must be host:port, got {self.tokenizer_address!r}",
        )
        require(
            1 <= self.max_request_mib <= 100,
            f"max_request_mib (maxRequestLength) must be in [1, 100], got {self.max_request_mib}",
        )
        require(
            self.request_timeout_s is None or 0 < self.request_timeout_s <= MAX_E2E_TIMEOUT_S,
            f"request_timeout_s (e2eTimeout) must be in (0, {MAX_E2E_TIMEOUT_S}], "
            f"got {self.request_timeout_s}",
        )
        require(16 <= self.stream_buffer_kib <= 65536,
                f"stream_buffer_kib must be in [16, 65536], got {self.stream_buffer_kib}")
        require(0 < self.stream_stall_timeout_s <= 3600,
                f"stream_stall_timeout_s must be in (0, 3600], got {self.stream_stall_timeout_s}")
        require(self.models_cache_s >= 0, f"models_cache_s must be >= 0, got {self.models_cache_s}")
        check_drain_timeout(self.drain_timeout_s)
        require(
            1 <= self.max_header_kib <= MAX_HEADER_KIB,
            f"max_header_kib must be in [1, {MAX_HEADER_KIB}], got {self.max_header_kib}",
        )
        require(
            1 <= self.max_headers <= MAX_HEADERS,
            f"max_headers must be in [1, {MAX_HEADERS}], got {self.max_headers}",
        )
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            require(
                0 < value <= MAX_E2E_TIMEOUT_S,
                f"{name} must be in (0, {MAX_E2E_TIMEOUT_S}], got {value}",
            )
        check_api_keys(self.api_keys)
        check_internal_tls(self)

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mib * 1024 * 1024

    @property
    def max_header_bytes(self) -> int:
        return self.max_header_kib * 1024
