"""scheduler.groups: G schedulers, each with its own workers behind its own
Service, and tokenizers that know every scheduler; one group renders as a
chart without groups."""
from __future__ import annotations

from services.common.config import load_config
from services.tokenizer.config import TokenizerConfig
from tests.chart import NAMESPACE, named, of_kind, selects, workloads
from tests.deploy.chart_values import CONFIGS, component, container_env, containers, notes, rendered

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
    scheduler_services = [s for s in _by_component(objects, "Service", "scheduler")
                          if s["metadata"]["name"] != component("schedulers")]  # every group's: for the tokenizers
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


def test_tokenizers_find_every_scheduler_through_the_schedulers_service():
    objects = rendered("two-groups")
    env = {m: container_env(objects, c) for _, c, m in containers(objects)}
    tokenizer = load_config(TokenizerConfig, [], env["tokenizer"])
    assert (tokenizer.scheduler_discovery, tokenizer.scheduler_service, tokenizer.scheduler_port) == \
        ("endpointslices", component("schedulers"), "grpc")
    assert tokenizer.scheduler_namespace == ""  # the pod's own
    # The Service selects every group's scheduler pod and nothing else, on the port the tokenizers name.
    service = named(objects, "Service", component("schedulers"))
    assert service["spec"]["clusterIP"] == "None"
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc"]  # no metrics port: scraped once
    assert [w["metadata"]["name"] for w in workloads(objects) if selects(service, w)] == \
        [component("scheduler-0"), component("scheduler-1")]
    (policy,) = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == component("scheduler")]
    for scheduler in _by_component(objects, "Deployment", "scheduler"):
        labels = scheduler["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_tokenizers_may_only_read_endpointslices_with_a_token_of_their_own():
    objects = rendered("two-groups")
    name = component("tokenizer")
    pod = named(objects, "Deployment", name)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    assert named(objects, "ServiceAccount", name)["automountServiceAccountToken"] is False  # the pod asks for it
    assert named(objects, "Role", name)["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = named(objects, "RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")


def test_a_static_list_of_schedulers_stays_available():
    objects = rendered("two-groups-static")
    env = {m: container_env(objects, c) for _, c, m in containers(objects)}
    tokenizer = load_config(TokenizerConfig, [], env["tokenizer"])
    assert tokenizer.scheduler_discovery == "static"
    assert tokenizer.scheduler_addresses == (f"{component('scheduler-0')}:50052", f"{component('scheduler-1')}:50052")
    pod = named(objects, "Deployment", component("tokenizer"))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert "fixed list of the groups' scheduler Services" in notes("two-groups-static")
    assert f"EndpointSlices of Service {component('schedulers')}" in notes("two-groups")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not kinds & {("ServiceAccount", component("tokenizer")), ("Role", component("tokenizer")),
                        ("RoleBinding", component("tokenizer")), ("Service", component("schedulers"))}


def test_one_group_needs_no_discovery_of_schedulers():
    objects = rendered("defaults")
    env = {m: container_env(objects, c) for _, c, m in containers(objects)}
    assert env["tokenizer"]["STORMSERVE_SCHEDULER_ADDRESS"] == f"{component('scheduler')}:50052"
    assert "STORMSERVE_SCHEDULER_DISCOVERY" not in env["tokenizer"]
    assert not [o for o in objects if o["metadata"]["name"] == component("schedulers")]


def test_each_groups_scheduler_and_workers_label_their_metrics_with_the_group():
    for value_set, groups in (("defaults", ["0"]), ("two-groups", ["0", "1"]), ("multi-node", ["0"])):
        objects = rendered(value_set)
        found = {}
        for workload, container, module in containers(objects):
            if module in ("scheduler", "worker", "worker.follower"):
                group = load_config(CONFIGS[module], [], container_env(objects, container)).serving_group
                assert workload["spec"]["template"]["metadata"]["labels"].get(GROUP_LABEL, "0") == group
                found.setdefault(module, []).append(group)
            else:
                assert "STORMSERVE_SERVING_GROUP" not in container_env(objects, container)
        assert sorted(set(found["scheduler"])) == sorted(set(found["worker"])) == groups


def test_static_workers_per_group():
    objects = rendered("two-groups-static")
    for group, scheduler in enumerate(_by_component(objects, "Deployment", "scheduler")):
        env = container_env(objects, scheduler["spec"]["template"]["spec"]["containers"][0])
        name = component(f"worker-{group}")
        assert env["STORMSERVE_WORKER_ADDRESSES"] == f"{name}-0.{name}.{NAMESPACE}.svc:50053"
    assert "2 serving groups" in notes("two-groups-static")
