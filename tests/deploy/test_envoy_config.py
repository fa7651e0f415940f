"""deploy/envoy: the rendered config passes the real Envoy's `--mode validate`
(plain, TLS, mutual TLS, internal mutual TLS to the upstreams) and carries the
edge's limits."""
from __future__ import annotations

import dataclasses
import subprocess

import pytest
import yaml

from services.common.config import load_config
from services.envoy.config import DESCRIPTOR, EnvoyConfig
from services.envoy.render import MIB, as_flags, envoy_binary, envoy_command, render, write
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from tests.tls import TestCA


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    return ca, ca.issue("envoy", server=True)


def configs(ca, server):
    return {
        "plain": EnvoyConfig(),
        "tls": EnvoyConfig(envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                           envoy_admin_path="/tmp/stormserve-envoy/admin.sock",
                           envoy_cors_origins=("https://app.example.com",)),
        "mtls": EnvoyConfig(envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                            envoy_client_ca_file=str(ca.cert)),
        "internal-tls": EnvoyConfig(internal_tls_cert_file=str(server.cert), internal_tls_key_file=str(server.key),
                                    internal_tls_ca_file=str(ca.cert)),
    }


def test_the_wheel_carries_envoy():
    version = subprocess.run([str(envoy_binary()), "--version"], capture_output=True, text=True, timeout=60)
    assert "/1.40.0/" in version.stdout, version.stdout + version.stderr


@pytest.mark.parametrize("kind", ["plain", "tls", "mtls", "internal-tls"])
def test_envoy_validates_the_rendered_config(kind, tls_files, tmp_path):
    assert DESCRIPTOR.exists(), "make descriptors builds it"
    config = configs(*tls_files)[kind]
    path = write(config, tmp_path / "envoy.yaml")
    result = subprocess.run(envoy_command(config, path, "--mode", "validate"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout + result.stderr


def parsed(config: EnvoyConfig) -> dict:
    return yaml.safe_load(render(config))


def manager(config: EnvoyConfig) -> dict:
    (listener,) = parsed(config)["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    return hcm["typed_config"]


def routes(config: EnvoyConfig) -> dict[str, dict]:
    """Each route by its path prefix (or path)."""
    (host,) = manager(config)["route_config"]["virtual_hosts"]
    return {r["match"].get("prefix") or r["match"]["path"]: r for r in host["routes"]}


GRPC_PREFIXES = ["/stormserve.chat.v1.ChatService/", "/grpc.reflection.v1.ServerReflection/",
                 "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.health.v1.Health/"]


def test_limits_follow_the_edge(tls_files):
    config = EnvoyConfig(max_request_mib=7, request_timeout_s=100)
    (buffer,) = [f for f in manager(config)["http_filters"] if f["name"] == "envoy.filters.http.buffer"]
    assert buffer["typed_config"]["max_request_bytes"] == 7 * MIB
    by_prefix = routes(config)
    # The edge's deadline and a margin: its own error comes first.
    assert by_prefix["/v1/"]["route"]["timeout"] == "130s"
    assert manager(config)["stream_idle_timeout"] == "130s"
    mtls = render(configs(*tls_files)["mtls"])
    assert "require_client_certificate: true" in mtls and str(tls_files[0].cert) in mtls
    assert manager(EnvoyConfig(request_timeout_s=None))["stream_idle_timeout"] == "0s"


def test_grpc_calls_are_bounded_by_the_chain_deadline():
    """gRPC routes have no response timeout (it would cut a stream) but a stream
    duration; a transcoded call is routed again by its gRPC path to the ChatService
    route, so the /v1/grpc/ route carries no limit of its own that could mislead."""
    by_prefix = routes(EnvoyConfig(request_timeout_s=100))
    for prefix in GRPC_PREFIXES:
        route = by_prefix[prefix]["route"]
        assert route["timeout"] == "0s", prefix
        assert route["max_stream_duration"] == {"max_stream_duration": "130s", "grpc_timeout_header_max": "130s"}
    assert by_prefix["/v1/grpc/"]["route"] == {"cluster": "tokenizer"}
    unlimited = routes(EnvoyConfig(request_timeout_s=None))["/stormserve.chat.v1.ChatService/"]["route"]
    assert unlimited["max_stream_duration"] == {"max_stream_duration": "0s", "grpc_timeout_header_max": "0s"}


def test_a_whole_request_has_the_head_and_body_time_the_edge_gives_it():
    """Envoy's buffer filter holds a body until it is complete, so the edge never sees
    a slow one: Envoy bounds it, with the edge's body_timeout_s after the head's time."""
    hcm = manager(EnvoyConfig(envoy_header_timeout_s=10, body_timeout_s=30))
    assert (hcm["request_headers_timeout"], hcm["request_timeout"]) == ("10s", "40s")
    assert manager(EnvoyConfig(envoy_header_timeout_s=2.5, body_timeout_s=5))["request_timeout"] == "7.5s"


def test_only_a_request_that_never_reached_the_service_is_retried():
    safe = {"connect-failure", "refused-stream", "reset-before-request"}
    by_prefix = routes(EnvoyConfig())
    retried = {prefix for prefix, r in by_prefix.items() if "retry_policy" in r["route"]}
    assert retried == set(by_prefix) - {"/v1/grpc/"}  # that route's action is never taken
    for prefix in retried:
        policy = by_prefix[prefix]["route"]["retry_policy"]
        assert set(policy["retry_on"].split(",")) <= safe, prefix  # never 5xx, gateway-error, reset
        assert set(policy) == {"retry_on", "num_retries"}, prefix  # no retriable status codes either


def clusters(config: EnvoyConfig) -> dict[str, dict]:
    return {c["name"]: c for c in parsed(config)["static_resources"]["clusters"]}


def test_circuit_breakers_let_through_what_the_scheduler_queues():
    """Envoy's defaults (1024 connections, requests, pending requests per cluster)
    would refuse SSE streams the scheduler would still take."""
    for config, limit in ((EnvoyConfig(), 8192), (EnvoyConfig(max_queue_size=100), 200)):
        for name, cluster in clusters(config).items():
            assert cluster["circuit_breakers"]["thresholds"] == [
                {"priority": "DEFAULT", "max_connections": limit, "max_pending_requests": limit,
                 "max_requests": limit}], name


def test_outlier_detection_ejects_for_failures_to_reach_a_host_only():
    for name, cluster in clusters(EnvoyConfig()).items():
        assert cluster["type"] == "STRICT_DNS", name  # each address the name resolves to is a host
        assert cluster["outlier_detection"] == {
            # Connect errors, timeouts and resets are counted apart from the answers...
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 5,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_local_origin_success_rate": 0,
            # ...and no answer of the service (a full queue's 503) ejects it.
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "base_ejection_time": "10s",
            # Envoy's default (10 %) would eject none of fewer than ten hosts.
            "max_ejection_percent": 50,
        }, name


def test_cors_for_grpc_web_only_where_origins_are_named():
    assert "envoy.filters.http.cors" not in render(EnvoyConfig())
    config = EnvoyConfig(envoy_cors_origins=("https://app.example.com", "http://localhost:3000"))
    names = [f["name"] for f in manager(config)["http_filters"]]
    assert names[0] == "envoy.filters.http.cors" and names[-1] == "envoy.filters.http.router"
    for prefix, route in routes(config).items():
        policy = route["typed_per_filter_config"].get("envoy.filters.http.cors")
        if prefix not in GRPC_PREFIXES:
            assert policy is None, prefix  # the REST edge and the transcoder have no CORS
            continue
        assert policy["allow_origin_string_match"] == [{"exact": "https://app.example.com"},
                                                       {"exact": "http://localhost:3000"}]
        assert set(policy["expose_headers"].split(",")) == {"grpc-status", "grpc-message",
                                                            "grpc-status-details-bin"}
        assert {"x-grpc-web", "content-type", "grpc-timeout"} <= set(policy["allow_headers"].split(","))
        assert policy["forward_not_matching_preflights"] is False
    for origin in ("app.example.com", "https://app.example.com/", "ftp://x"):
        with pytest.raises(ValueError, match="envoy_cors_origins"):
            EnvoyConfig(envoy_cors_origins=(origin,))


def test_internal_tls_reaches_both_upstreams_with_the_services_certificate(tls_files):
    ca, server = tls_files
    config = configs(ca, server)["internal-tls"]
    clusters = {c["name"]: c for c in parsed(config)["static_resources"]["clusters"]}
    for name, alpn in (("http_edge", "http/1.1"), ("tokenizer", "h2")):
        socket = clusters[name]["transport_socket"]
        context = socket["typed_config"]
        assert socket["name"] == "envoy.transport_sockets.tls"
        assert context["@type"].endswith("UpstreamTlsContext") and context["sni"] == "stormserve.internal"
        common = context["common_tls_context"]
        assert common["alpn_protocols"] == [alpn]
        assert common["tls_certificates"] == [{"certificate_chain": {"filename": str(server.cert)},
                                               "private_key": {"filename": str(server.key)}}]
        assert common["validation_context"] == {
            "trusted_ca": {"filename": str(ca.cert)},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "stormserve.internal"}}]}
    # Off by default; the listener's own TLS is a separate matter.
    for kind in ("plain", "mtls"):
        other_clusters = parsed(configs(ca, server)[kind])["static_resources"]["clusters"]
        assert all("transport_socket" not in c for c in other_clusters)
    assert "transport_socket" not in parsed(config)["static_resources"]["listeners"][0]["filter_chains"][0]


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
        "STORMSERVE_TOKENIZER_ADDRESS": "tok:50061", "STORMSERVE_MAX_QUEUE_SIZE": "50",
        "STORMSERVE_ENVOY_CORS_ORIGINS": "https://a.example, http://b.example:8080"})
    assert (config.envoy_port, config.tokenizer, config.max_request_mib, config.request_timeout_s) == (
        9090, ("tok", 50061), 3, None)
    assert (config.max_queue_size, config.envoy_cors_origins) == (50, ("https://a.example", "http://b.example:8080"))
    assert "max_active_downstream_connections: 4096" in render(config)
    assert load_config(EnvoyConfig, argv=as_flags(config), environ={}) == config


@pytest.mark.parametrize(("owner", "name"), [(EdgeConfig, "max_request_mib"), (EdgeConfig, "request_timeout_s"),
                                             (EdgeConfig, "body_timeout_s"), (SchedulerConfig, "max_queue_size")])
def test_a_setting_envoy_shares_has_its_owners_default(owner, name):
    """Envoy reads the edge's and the scheduler's settings under their names: with
    nothing set, it must hold the same values, or it refuses what the chain takes."""
    defaults = {f.name: f.default for f in dataclasses.fields(owner)}
    assert {f.name: f.default for f in dataclasses.fields(EnvoyConfig)}[name] == defaults[name]
