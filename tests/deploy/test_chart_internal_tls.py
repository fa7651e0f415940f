"""The chart's internal mutual TLS (tls.internal, docs/operating/security.md), rendered by
the real Helm engine: off by default; on, every component (edge, tokenizer,
scheduler, worker, Envoy) mounts the one Secret and reads its files through the
shared settings, the gRPC probes ask the plaintext health-only port, the edge's
probe and Prometheus use HTTPS; cert-manager mode renders a Certificate (a CRD:
checked field by field here) for the Secret the pods mount. Strict API
validation of these value sets: test_chart.py."""
from __future__ import annotations

import helm_python as helm
import pytest

from services.common.config import load_config
from services.common.tls import InternalTls
from tests.chart import CHART, NAMESPACE, RELEASE, of_kind, render, workloads
from tests.deploy.chart_values import CONFIGS, VALUE_SETS, component, container_env, containers, notes, rendered

MOUNT = "/etc/stormserve/internal-tls"
MODULES = {"http_edge", "tokenizer", "scheduler", "worker", "envoy"}
GRPC_MODULES = {"tokenizer", "scheduler", "worker"}


def internal_tls_volumes(workload: dict) -> list[dict]:
    return [v for v in workload["spec"]["template"]["spec"].get("volumes", []) if v["name"] == "internal-tls"]


def probes(container: dict) -> dict[str, dict]:
    return {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}


def test_off_by_default():
    objects = rendered("defaults")
    assert not of_kind(objects, "Certificate")
    (config_map,) = of_kind(objects, "ConfigMap")
    assert not [name for name in config_map["data"] if "INTERNAL_TLS" in name]
    for workload, container, module in containers(objects):
        assert not internal_tls_volumes(workload)
        assert InternalTls.of(load_config(CONFIGS[module], [], container_env(objects, container))) is None
        assert "health" not in {p["name"] for p in container["ports"]}
        if module in GRPC_MODULES:
            ports = {p["containerPort"] for p in container["ports"] if p["name"] == "grpc"}
            assert probes(container)["readinessProbe"]["grpc"]["port"] in ports


@pytest.mark.parametrize(("value_set", "secret", "server_name"), [
    ("internal-tls-secret", "stormserve-internal-tls", "stormserve.internal"),
    ("internal-tls-cert-manager", f"{RELEASE}-stormserve-internal-tls", "llm.internal.example"),
])
def test_every_component_mounts_the_secret_and_reads_its_files(value_set, secret, server_name):
    objects = rendered(value_set)
    seen = set()
    for workload, container, module in containers(objects):
        seen.add(module)
        where = workload["metadata"]["name"]
        (volume,) = internal_tls_volumes(workload)
        assert volume["secret"] == {"secretName": secret}, where
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "internal-tls"]
        assert mount == {"name": "internal-tls", "mountPath": MOUNT, "readOnly": True}, where
        config = load_config(CONFIGS[module], [], container_env(objects, container))
        assert InternalTls.of(config) == InternalTls(f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key", f"{MOUNT}/ca.crt",
                                                     server_name), where
    assert seen == (MODULES if value_set == "internal-tls-secret" else MODULES - {"envoy"})


@pytest.mark.parametrize("value_set", ["internal-tls-secret", "internal-tls-cert-manager"])
def test_probes_still_work_without_a_client_certificate(value_set):
    objects = rendered(value_set)
    for workload, container, module in containers(objects):
        where = workload["metadata"]["name"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = container_env(objects, container)
        if module in GRPC_MODULES:
            # The process opens the health-only port the probes ask; the probes ask nothing else over gRPC.
            assert ports["health"] == 8086 == load_config(CONFIGS[module], [], env).health_port, where
            grpc_probes = [p["grpc"] for p in probes(container).values() if "grpc" in p]
            assert grpc_probes and all(p["port"] == ports["health"] for p in grpc_probes), where
        else:
            assert "health" not in ports and "STORMSERVE_HEALTH_PORT" not in env, where
        if module == "http_edge":
            assert probes(container)["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http",
                                                                      "scheme": "HTTPS"}


def test_cert_manager_issues_one_certificate_for_both_ends_naming_the_server_name():
    (certificate,) = of_kind(rendered("internal-tls-cert-manager"), "Certificate")
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    spec = certificate["spec"]
    assert certificate["metadata"]["name"] == spec["secretName"] == f"{RELEASE}-stormserve-internal-tls"
    assert spec["dnsNames"] == ["llm.internal.example"]
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"] == {"name": "stormserve-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert spec["privateKey"]["algorithm"] == "ECDSA" and spec["duration"] == "2160h"
    assert set(spec) <= {"secretName", "secretTemplate", "dnsNames", "usages", "duration", "renewBefore",
                         "privateKey", "issuerRef"}  # fields of cert-manager's v1 CertificateSpec
    assert not of_kind(rendered("internal-tls-secret"), "Certificate")  # the operator's Secret: nothing to issue


def test_prometheus_scrapes_the_edge_over_https_with_the_internal_ca():
    (monitor,) = of_kind(rendered("internal-tls-cert-manager"), "PodMonitor")
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["http"]["scheme"] == "https"
    assert endpoints["http"]["tlsConfig"] == {
        "ca": {"secret": {"name": f"{RELEASE}-stormserve-internal-tls", "key": "ca.crt"}},
        "serverName": "llm.internal.example"}
    assert "scheme" not in endpoints["metrics"]  # the gRPC services' metrics ports stay plain HTTP
    values = {**VALUE_SETS["internal-tls-secret"],
              "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}}
    (monitor,) = of_kind(render(values), "ServiceMonitor")
    (edge,) = [e for e in monitor["spec"]["endpoints"] if e["port"] == "http"]
    assert edge["scheme"] == "https" and edge["tlsConfig"]["ca"]["secret"]["name"] == "stormserve-internal-tls"


def test_notes_say_the_edge_wants_a_client_certificate():
    values = {"tls": {"internal": {"enabled": True, "secretName": "stormserve-internal-tls"}}}
    with helm.Chart.load(CHART) as chart:
        text = next(t for p, t in chart.render(values, name=RELEASE, namespace=NAMESPACE).items()
                    if p.endswith("NOTES.txt"))
    assert "export STORMSERVE_URL=https://127.0.0.1:8000" in text and "certificate from" in text
    assert "certificate from" not in notes("internal-tls-secret")  # Envoy in front takes the clients


@pytest.mark.parametrize(("values", "message"), [
    ({"enabled": True}, "tls.internal.enabled needs tls.internal.secretName"),
    ({"enabled": True, "secretName": "s", "certManager": {"issuerRef": {"name": "ca"}}}, "exclude each other"),
    ({"enabled": True, "secretName": "s", "healthPort": 50051}, "tls.internal.healthPort (50051) must differ"),
])
def test_values_the_schema_cannot_judge_fail_the_render_clearly(values, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmRenderError) as refused:
            chart.render({"tls": {"internal": values}}, name=RELEASE, namespace=NAMESPACE)
    assert message in str(refused.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"serverName": "Not_A_DNS_Name"}, "at '/tls/internal/serverName'"),
    ({"certManager": {"issuerRef": {"kind": "Vault"}}}, "at '/tls/internal/certManager/issuerRef/kind'"),
    ({"healthPort": 0}, "at '/tls/internal/healthPort'"),
    ({"mtls": True}, "additional properties 'mtls' not allowed"),
])
def test_the_schema_refuses_bad_values_clearly(values, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.render({"tls": {"internal": values}}, name=RELEASE, namespace=NAMESPACE)
    assert message in str(refused.value)


def test_nothing_else_in_the_release_changes_with_the_secret_named_but_tls_off():
    values = {"tls": {"internal": {"secretName": "stormserve-internal-tls"}}}
    assert [w["spec"]["template"]["spec"] for w in workloads(render(values))] == \
        [w["spec"]["template"]["spec"] for w in workloads(rendered("defaults"))]
    assert component("edge") in {w["metadata"]["name"] for w in workloads(render(values))}
