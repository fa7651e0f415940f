"""Envoy in the Helm chart (envoy.enabled): what the pod runs is a config the real
Envoy accepts, it fronts the edge and the tokenizers' Services, its TLS comes
from the Secrets it mounts, it drains before SIGTERM, and it is the release's
only entry point."""
from __future__ import annotations

import dataclasses
import subprocess

import helm_python as helm
import pytest

from services.common.config import load_config
from services.envoy.config import EnvoyConfig
from services.envoy.render import envoy_command, render, write
from tests.chart import CHART, NAMESPACE, RELEASE, named, of_kind, render as render_chart, render_files
from tests.tls import TestCA

VALUES = {
    "envoy": {"enabled": True, "service": {"type": "LoadBalancer"},
              "tls": {"secretName": "stormserve-tls", "clientCASecretName": "stormserve-client-ca"}},
    "networkPolicy": {"edgeFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
    "config": {"MAX_REQUEST_MIB": "8", "REQUEST_TIMEOUT_S": "300"},
}
LABELS = {"app.kubernetes.io/name": "stormserve", "app.kubernetes.io/instance": RELEASE}


def component(name: str) -> str:
    return f"{RELEASE}-stormserve-{name}"


def envoy_pod(objects):
    pod = named(objects, "Deployment", component("envoy"))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = dict(named(objects, "ConfigMap", f"{RELEASE}-stormserve-config")["data"])
    env |= {e["name"]: e["value"] for e in container["env"]}
    return pod, container, env


def test_off_by_default():
    objects = render_chart({})
    assert not [o for o in objects if o["metadata"]["name"] == component("envoy")]


def test_the_pod_runs_a_config_envoy_accepts_in_front_of_the_services(tmp_path):
    objects = render_chart(VALUES)
    pod, container, env = envoy_pod(objects)
    assert container["command"] == ["python", "-m", "services.envoy"]
    config = load_config(EnvoyConfig, [], env)
    # It reaches each pod of the edge and of the tokenizer, through headless Services.
    for address, name in ((config.edge, "edge"), (config.tokenizer, "tokenizer")):
        host, port = address
        service = named(objects, "Service", host)
        assert service["spec"]["clusterIP"] == "None"  # the name resolves to every ready pod
        assert service["spec"]["selector"] == named(objects, "Service", component(name))["spec"]["selector"]
        (pod_container,) = named(objects, "Deployment", component(name))["spec"]["template"]["spec"]["containers"]
        (service_port,) = service["spec"]["ports"]
        # No Service in between maps ports: Envoy dials the pod's own, the one the policy opens.
        (opened,) = [p for p in pod_container["ports"] if p["name"] == service_port["targetPort"]]
        assert port == service_port["port"] == opened["containerPort"]
        # The ServiceMonitor scrapes ports named http and metrics: not these again.
        assert service_port["name"] not in ("http", "metrics")
        # The component's own ClusterIP Service stays for its other callers.
        assert named(objects, "Service", component(name))["spec"].get("clusterIP") != "None"
    # Its limits are the edge's and the scheduler's, from the same ConfigMap.
    assert (config.max_request_mib, config.request_timeout_s, config.max_queue_size) == (8, 300.0, 4096)
    assert "STORMSERVE_MAX_QUEUE_SIZE" in named(objects, "ConfigMap", f"{RELEASE}-stormserve-config")["data"]
    # TLS files are where the Secrets are mounted.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "stormserve-tls"
    assert volumes["client-ca"]["secret"]["secretName"] == "stormserve-client-ca"
    assert config.envoy_cert_file == mounts["tls"] + "/tls.crt" and config.envoy_key_file == mounts["tls"] + "/tls.key"
    assert config.envoy_client_ca_file == mounts["client-ca"] + "/ca.crt"
    # The real Envoy validates what this pod would render (test files in place of the Secrets).
    ca = TestCA(tmp_path)
    server = ca.issue("envoy", server=True)
    local = dataclasses.replace(config, envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                                envoy_client_ca_file=str(ca.cert), envoy_admin_path=str(tmp_path / "admin.sock"))
    assert render(local).count("/etc/stormserve") == 0
    path = write(local, tmp_path / "envoy.yaml")
    result = subprocess.run(envoy_command(local, path, "--mode", "validate"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_it_drains_before_sigterm_within_the_grace_period():
    objects = render_chart(VALUES)
    pod, container, env = envoy_pod(objects)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and command[2].endswith("&& exec python -m services.envoy --drain")
    config = load_config(EnvoyConfig, [], env)
    assert config.admin_url is not None  # what --drain talks to
    assert config.envoy_admin_path.startswith("/tmp/")  # an emptyDir: the root filesystem is read-only
    sleep = int(command[2].split()[1])
    assert pod["terminationGracePeriodSeconds"] >= sleep + config.drain_timeout_s + 5


def test_envoy_is_the_only_entry_point():
    objects = render_chart(VALUES)
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
                for p in of_kind(objects, "NetworkPolicy")}
    (outside,) = policies["envoy"]["spec"]["ingress"]
    assert outside == {"ports": [{"port": "http", "protocol": "TCP"}], "from": VALUES["networkPolicy"]["edgeFrom"]}

    def from_pods(rule) -> set[str]:
        assert all(set(peer) == {"podSelector"} for peer in rule["from"])
        return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]}

    (edge_rule,) = policies["edge"]["spec"]["ingress"]
    assert from_pods(edge_rule) == {"envoy"}  # no longer from outside
    (tokenizer_rule,) = policies["tokenizer"]["spec"]["ingress"]
    assert from_pods(tokenizer_rule) == {"edge", "envoy"}  # native gRPC callers come through Envoy
    assert named(objects, "Service", component("envoy"))["spec"]["type"] == "LoadBalancer"
    assert named(objects, "Service", component("edge"))["spec"]["type"] == "ClusterIP"


def test_mutual_tls_without_server_tls_fails_the_render_clearly():
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmRenderError) as refused:
            chart.render({"envoy": {"enabled": True, "tls": {"clientCASecretName": "ca"}}}, name=RELEASE,
                         namespace=NAMESPACE)
    assert "envoy.tls.clientCASecretName (mutual TLS) needs envoy.tls.secretName" in str(refused.value)


def test_notes_point_at_envoy():
    (text,) = [t for path, t in render_files(VALUES).items() if path.endswith("NOTES.txt")]
    assert f"export STORMSERVE_URL=https://$(kubectl -n {NAMESPACE} get service {component('envoy')}" in text
    assert "Mutual TLS: clients need a certificate from the CA in Secret stormserve-client-ca" in text
