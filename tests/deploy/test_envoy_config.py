"""deploy/envoy: the rendered config passes the real Envoy's `--mode validate`
(plain, TLS, mutual TLS) and carries the edge's limits."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from services.common.config import load_config
from services.envoy.config import DESCRIPTOR, EnvoyConfig
from services.envoy.render import MIB, as_flags, envoy_binary, envoy_command, render, write
from tests.tls import TestCA


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    return ca, ca.issue("envoy", server=True)


def configs(ca, server):
    return {
        "plain": EnvoyConfig(),
        "tls": EnvoyConfig(envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                           envoy_admin_path="/tmp/stormserve-envoy/admin.sock"),
        "mtls": EnvoyConfig(envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                            envoy_client_ca_file=str(ca.cert)),
    }


def test_the_wheel_carries_envoy():
    version = subprocess.run([str(envoy_binary()), "--version"], capture_output=True, text=True, timeout=60)
    assert "/1.40.0/" in version.stdout, version.stdout + version.stderr


@pytest.mark.parametrize("kind", ["plain", "tls", "mtls"])
def test_envoy_validates_the_rendered_config(kind, tls_files, tmp_path):
    assert DESCRIPTOR.exists(), "make descriptors builds it"
    config = configs(*tls_files)[kind]
    path = write(config, tmp_path / "envoy.yaml")
    result = subprocess.run(envoy_command(config, path, "--mode", "validate"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout + result.stderr


def test_limits_follow_the_edge(tls_files):
    config = yaml.safe_load(render(EnvoyConfig(max_request_mib=7, request_timeout_s=100)))
    text = repr(config)
    assert f"'max_request_bytes': {7 * MIB}" in text
    assert "'timeout': '130s'" in text  # the edge's deadline and a margin: its own error comes first
    assert "'stream_idle_timeout': '130s'" in text
    assert "connect-failure,refused-stream,reset-before-request" in text
    assert "'5xx'" not in text and "gateway-error" not in text  # a generation is never retried
    mtls = render(configs(*tls_files)["mtls"])
    assert "require_client_certificate: true" in mtls and str(tls_files[0].cert) in mtls
    unlimited = render(EnvoyConfig(request_timeout_s=None))
    assert "stream_idle_timeout: 0s" in unlimited


def test_half_tls_is_refused():
    with pytest.raises(ValueError):
        EnvoyConfig(envoy_cert_file="a.pem")
    with pytest.raises(ValueError):
        EnvoyConfig(envoy_client_ca_file="ca.pem")
    with pytest.raises(ValueError):
        EnvoyConfig(edge_address="no-port")


def test_settings_come_from_the_environment_and_round_trip_as_flags():
    assert load_config(EnvoyConfig, argv=[], environ={}).url == "http://127.0.0.1:8080"
    config = load_config(EnvoyConfig, argv=[], environ={
        "STORMSERVE_ENVOY_PORT": "9090", "STORMSERVE_MAX_REQUEST_MIB": "3", "STORMSERVE_REQUEST_TIMEOUT_S": "",
        "STORMSERVE_TOKENIZER_ADDRESS": "tok:50061"})
    assert (config.envoy_port, config.tokenizer, config.max_request_mib, config.request_timeout_s) == (
        9090, ("tok", 50061), 3, None)
    assert "max_active_downstream_connections: 4096" in render(config)
    assert load_config(EnvoyConfig, argv=as_flags(config), environ={}) == config
