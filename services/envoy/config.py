"""Envoy's typed config: flags and STORMSERVE_* variables like every service's.

Its limits share their names with the edge's settings (`max_request_mib`,
`request_timeout_s`, `body_timeout_s`) and the scheduler's (`max_queue_size`), so
one environment keeps them consistent: Envoy refuses nothing the chain would take
and answers first what the edge would refuse."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.config import require, setting
from services.common.drain import drain_timeout_setting
from services.common.tls import InternalTlsSettings, check_internal_tls

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTOR = ROOT / "gen" / "stormserve.pb"
DEFAULT_PORT = 8080


def _address(name: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    require(bool(sep and host and port.isdigit()), f"{name} must be host:port, got {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class EnvoyConfig(InternalTlsSettings):
    """Envoy in front of the HTTP edge and the ChatService (deploy/envoy)."""

    envoy_host: str = setting("127.0.0.1", "address Envoy listens on")
    envoy_port: int = setting(DEFAULT_PORT, "Envoy's one listener: REST/SSE, gRPC, gRPC-Web, transcoded JSON")
    edge_address: str = setting("127.0.0.1:8000", "host:port of the HTTP edge")
    tokenizer_address: str = setting("127.0.0.1:50051", "host:port of the ChatService (tokenizer) gRPC server")
    envoy_admin_port: int = setting(0, "Envoy's admin interface on 127.0.0.1; 0 means none")
    envoy_admin_path: str = setting(
        "", "Unix socket of Envoy's admin interface instead of a port (what `--drain` talks to); empty means none")
    drain_timeout_s: float = drain_timeout_setting()
    descriptor_path: str = setting(str(DESCRIPTOR), "descriptor set of the protos (`make descriptors`)")
    max_request_mib: int = setting(40, "largest request body in MiB (the edge's); larger gets 413 from Envoy",
                                   alias="maxRequestLength")
    request_timeout_s: float | None = setting(
        600.0, "the edge's request deadline; Envoy's route and stream-idle timeouts are 30 s more; "
        "empty means none", alias="e2eTimeout")
    body_timeout_s: float = setting(
        30.0, "the edge's: seconds a request body may take to arrive; Envoy gives a whole request "
        "envoy_header_timeout_s and this")
    max_queue_size: int = setting(
        4096, "the scheduler's; Envoy lets twice as many requests (and connections) be in flight to the "
        "edge, and as many to the tokenizer, before it answers 503 itself")
    envoy_header_timeout_s: float = setting(10.0, "seconds a request head may take to arrive")
    envoy_idle_timeout_s: float = setting(300.0, "seconds a client connection with no stream open stays")
    envoy_connect_timeout_s: float = setting(5.0, "seconds to connect to the edge or the tokenizer")
    envoy_max_concurrent_streams: int = setting(128, "streams per HTTP/2 connection")
    envoy_max_connections: int = setting(4096, "open client connections, all together")
    envoy_cert_file: str = setting("", "server certificate chain (PEM); with envoy_key_file turns on TLS")
    envoy_key_file: str = setting("", "server private key (PEM)")
    envoy_client_ca_file: str = setting(
        "", "CA bundle (PEM) for mutual TLS: a client without a certificate from it is refused")
    envoy_cors_origins: tuple[str, ...] = setting(
        (), "comma list of origins (https://app.example.com) whose pages may call gRPC-Web (CORS); "
        "none means no CORS")
    # Internal mutual TLS (services/common/tls.py), the services' settings: with them Envoy
    # reaches the edge (HTTPS) and the tokenizer (gRPC) over TLS, presenting this certificate.

    def __post_init__(self) -> None:
        _address("edge_address", self.edge_address)
        _address("tokenizer_address", self.tokenizer_address)
        require(0 < self.envoy_port <= 65535, f"envoy_port must be in (0, 65535], got {self.envoy_port}")
        require(1 <= self.max_request_mib <= 100, f"max_request_mib must be in [1, 100], got {self.max_request_mib}")
        require(self.body_timeout_s > 0, f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        require(self.max_queue_size >= 1, f"max_queue_size must be >= 1, got {self.max_queue_size}")
        for origin in self.envoy_cors_origins:  # what a browser sends: scheme://host[:port], nothing after
            scheme, sep, rest = origin.partition("://")
            require(scheme in ("http", "https") and sep and rest and "/" not in rest,
                    f"envoy_cors_origins: {origin!r} is not an origin like https://app.example.com")
        require(not (self.envoy_admin_port and self.envoy_admin_path),
                "envoy_admin_port and envoy_admin_path exclude each other: the admin interface has one address")
        require(bool(self.envoy_cert_file) == bool(self.envoy_key_file),
                "TLS needs both envoy_cert_file and envoy_key_file")
        require(not self.envoy_client_ca_file or bool(self.envoy_cert_file),
                "mutual TLS (envoy_client_ca_file) needs server TLS (envoy_cert_file, envoy_key_file)")
        check_internal_tls(self)

    @property
    def edge(self) -> tuple[str, int]:
        return _address("edge_address", self.edge_address)

    @property
    def tokenizer(self) -> tuple[str, int]:
        return _address("tokenizer_address", self.tokenizer_address)

    @property
    def admin_url(self) -> str | None:
        """Where the admin interface answers (an httpx base URL), or None."""
        if self.envoy_admin_port:
            return f"http://127.0.0.1:{self.envoy_admin_port}"
        return "http://envoy-admin" if self.envoy_admin_path else None

    @property
    def url(self) -> str:
        return f"{'https' if self.envoy_cert_file else 'http'}://{self.envoy_host}:{self.envoy_port}"
