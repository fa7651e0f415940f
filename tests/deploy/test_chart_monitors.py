"""The chart's prometheus-operator monitors (metrics.podMonitor,
metrics.serviceMonitor): every target either one selects serves /metrics on
the port it scrapes — Envoy's pods, whose port is named http too, are left out
— every service that serves metrics is a target, and the two monitors are
never on at once (every pod would be scraped twice)."""
from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart import CHART, NAMESPACE, RELEASE, of_kind, render, selects, workloads

# The port each service serves /metrics on, by the module its container runs.
METRICS_PORTS = {"http_edge": "http", "tokenizer": "metrics", "scheduler": "metrics", "worker": "metrics"}


def values(monitor: str, envoy: bool) -> dict:
    return {"metrics": {"enabled": True, monitor: {"enabled": True, "interval": "15s"}},
            "envoy": {"enabled": envoy}}


def matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for rule in selector.get("matchExpressions", []):
        key, operator = rule["key"], rule["operator"]
        found = {"In": key in labels and labels[key] in rule.get("values", []),
                 "NotIn": labels.get(key) not in rule.get("values", []),
                 "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not found:
            return False
    return True


def pod_ports(workload: dict) -> dict[str, str]:
    """The named ports of a workload's pods: the module whose container opens each."""
    return {port["name"]: container["command"][2].removeprefix("services.")
            for container in workload["spec"]["template"]["spec"]["containers"] for port in container["ports"]}


def pod_monitor_targets(objects) -> set[tuple[str, str]]:
    """(module, port) of every target the PodMonitor gives Prometheus."""
    (monitor,) = of_kind(objects, "PodMonitor")
    spec, targets = monitor["spec"], set()
    for workload in workloads(objects):
        if matches(spec["selector"], workload["spec"]["template"]["metadata"]["labels"]):
            ports = pod_ports(workload)
            targets |= {(ports[e["port"]], e["port"]) for e in spec["podMetricsEndpoints"] if e["port"] in ports}
    return targets


def service_monitor_targets(objects) -> set[tuple[str, str]]:
    """(module, container port) of every target the ServiceMonitor gives Prometheus:
    each selected Service's port of an endpoint's name, followed to its pods."""
    (monitor,) = of_kind(objects, "ServiceMonitor")
    spec, targets = monitor["spec"], set()
    for service in of_kind(objects, "Service"):
        if not matches(spec["selector"], service["metadata"]["labels"]):
            continue
        scraped = {e["port"] for e in spec["endpoints"]}
        for port in service["spec"]["ports"]:
            if port["name"] in scraped:
                for workload in workloads(objects):
                    if selects(service, workload):
                        targets.add((pod_ports(workload)[port["targetPort"]], port["targetPort"]))
    return targets


@pytest.mark.parametrize("envoy", [True, False], ids=["envoy", "no-envoy"])
@pytest.mark.parametrize(("monitor", "targets"), [("podMonitor", pod_monitor_targets),
                                                  ("serviceMonitor", service_monitor_targets)])
def test_every_target_serves_metrics_and_every_service_that_does_is_one(monitor, targets, envoy):
    objects = render(values(monitor, envoy))
    assert targets(objects) == set(METRICS_PORTS.items())
    (rendered,) = of_kind(objects, {"podMonitor": "PodMonitor", "serviceMonitor": "ServiceMonitor"}[monitor])
    endpoints = rendered["spec"]["podMetricsEndpoints" if monitor == "podMonitor" else "endpoints"]
    assert {(e["path"], e["interval"]) for e in endpoints} == {("/metrics", "15s")}


def test_both_monitors_at_once_are_refused():
    both = {"metrics": {"enabled": True, "podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmRenderError) as refused:
            chart.render(both, name=RELEASE, namespace=NAMESPACE)
    assert "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled both scrape every pod" in str(refused.value)
