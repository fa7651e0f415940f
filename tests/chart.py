"""The Helm chart in deploy/k8s rendered by a real Helm v4 engine (the
`helm-python-sdk` wheel), and lookups in what it renders; shared by the chart's
tests (tests/deploy) and the test that runs the rendered pods (tests/e2e)."""
from __future__ import annotations

import copy
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "k8s"
RELEASE, NAMESPACE = "demo", "llm"


def render_files(values: dict, release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """Every file the chart renders (manifests and NOTES.txt), by its path."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(copy.deepcopy(values), name=release, namespace=namespace)


def render(values: dict, release: str = RELEASE, namespace: str = NAMESPACE) -> tuple[dict, ...]:
    """The Kubernetes objects the chart renders for `values`."""
    objects = []
    for path, text in render_files(values, release, namespace).items():
        if path.endswith(".yaml"):
            objects += [o for o in yaml.safe_load_all(text) if o]
    return tuple(objects)


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind: str, name: str) -> dict:
    (obj,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return obj


def workloads(objects) -> list[dict]:
    """Deployments and StatefulSets; a LeaderWorkerSet's leader and worker pod
    templates each as a workload of its own (spec.template, spec.replicas: its pods)."""
    found = []
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            found.append(o)
        elif o["kind"] == "LeaderWorkerSet":
            groups, template = o["spec"].get("replicas", 1), o["spec"]["leaderWorkerTemplate"]
            for role, replicas in (("leaderTemplate", groups), ("workerTemplate", groups * (template["size"] - 1))):
                found.append({"kind": "LeaderWorkerSet", "metadata": {"name": f"{o['metadata']['name']} {role}"},
                              "spec": {"replicas": replicas, "template": template[role]}})
    return found


def selects(service: dict, workload: dict) -> bool:
    """Whether `service`'s selector matches the pods of `workload`."""
    selector = service["spec"].get("selector") or {}
    return bool(selector) and selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()
