"""scheduler.groups: G schedulers, each with its own workers behind its own
Service, and tokenizers that know every scheduler; one group renders as a
chart without groups."""
from __future__ import annotations

from services.common.config import load_config
from services.tokenizer.config import TokenizerConfig
from tests.chart import NAMESPACE, of_kind, selects
from tests.deploy.chart_values import component, container_env, containers, notes, rendered

GROUP_LABEL = "stormserve.io/group"


def _by_component(objects, kind: str, name: str) -> list[dict]:
    return [o for o in of_kind(objects, kind) if o["metadata"]["labels"]["app.kubernetes.io/component"] == name]


def test_one_group_has_no_group_names_or_labels():
    objects = rendered("defaults")
    assert not [o for o in objects if GROUP_LABEL in o["metadata"].get("labels", {})]
    (scheduler,) = _by_component(objects, "Deployment", "scheduler")
    assert scheduler["metadata"]["name"] == component("scheduler")
    env = {m: container_env(objects, c) for _, c, m in containers(objects)}
    assert "STORMSERVE_SCHEDULER_ADDRESSES" not in env["tokenizer"]


def test_each_group_has_its_scheduler_and_its_own_workers():
    objects = rendered("two-groups")
    schedulers = _by_component(objects, "Deployment", "scheduler")
    scheduler_services = _by_component(objects, "Service", "scheduler")
    worker_sets = of_kind(objects, "StatefulSet")
    assert [o["metadata"]["name"] for o in schedulers] == [component("scheduler-0"), component("scheduler-1")]
    assert [o["metadata"]["name"] for o in worker_sets] == [component("worker-0"), component("worker-1")]
    assert [w["spec"]["replicas"] for w in worker_sets] == [2, 2]  # worker.replicas per group
    for group, (scheduler, service, workers) in enumerate(zip(schedulers, scheduler_services, worker_sets)):
        assert scheduler["metadata"]["labels"][GROUP_LABEL] == str(group)
        # Each Service reaches its own group's pods alone.
        assert [selects(service, s) for s in schedulers] == [g == group for g in range(2)]
        env = container_env(objects, scheduler["spec"]["template"]["spec"]["containers"][0])
        assert env["STORMSERVE_WORKER_SERVICE"] == workers["spec"]["serviceName"] == component(f"worker-{group}")
        worker_services = [s for s in _by_component(objects, "Service", "worker")
                           if s["metadata"]["name"] == workers["spec"]["serviceName"]]
        assert [selects(worker_services[0], w) for w in worker_sets] == [g == group for g in range(2)]


def test_tokenizers_know_every_scheduler_and_may_reach_them():
    objects = rendered("two-groups")
    env = {m: container_env(objects, c) for _, c, m in containers(objects)}
    tokenizer = load_config(TokenizerConfig, [], env["tokenizer"])
    assert tokenizer.scheduler_addresses == (f"{component('scheduler-0')}:50052", f"{component('scheduler-1')}:50052")
    (policy,) = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == component("scheduler")]
    for scheduler in _by_component(objects, "Deployment", "scheduler"):
        labels = scheduler["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_static_workers_per_group():
    objects = rendered("two-groups-static")
    for group, scheduler in enumerate(_by_component(objects, "Deployment", "scheduler")):
        env = container_env(objects, scheduler["spec"]["template"]["spec"]["containers"][0])
        name = component(f"worker-{group}")
        assert env["STORMSERVE_WORKER_ADDRESSES"] == f"{name}-0.{name}.{NAMESPACE}.svc:50053"
    assert "2 serving groups" in notes("two-groups-static")
