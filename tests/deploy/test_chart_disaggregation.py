"""worker.disaggregation: a prefill pool and a decode pool per serving group, each
a StatefulSet whose workers know their role and the address their transfer
engine is reached on, both behind the worker Service the scheduler watches;
off, the chart renders as without it. Lint and strict validation against the
Kubernetes 1.29 and 1.37 schemas: test_chart.py, for the value sets named here."""
from __future__ import annotations

import copy

import helm_python as helm
import pytest

from services.common.config import load_config
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.chart import CHART, NAMESPACE, RELEASE, named, of_kind, render, render_files, selects, workloads
from tests.deploy.chart_values import VALUE_SETS, component, container_env, containers, notes, rendered

ROLE_LABEL = "stormserve.io/role"
GROUP_LABEL = "stormserve.io/group"
ON = {"worker": {"disaggregation": {"enabled": True}}}


def _pools(objects) -> dict[str, dict]:
    """The worker StatefulSets by name."""
    return {s["metadata"]["name"]: s for s in of_kind(objects, "StatefulSet")}


def _worker_env(objects, workers) -> dict[str, str]:
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    return container_env(objects, container)


def _refused(values) -> str:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmRenderError) as refused:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return str(refused.value)


def test_a_pool_per_role_each_worker_knowing_its_role():
    objects = rendered("disaggregated")
    pools = _pools(objects)
    assert list(pools) == [component("worker-prefill"), component("worker-decode")]
    for role, replicas in (("prefill", 2), ("decode", 3)):
        workers = pools[component(f"worker-{role}")]
        assert workers["spec"]["replicas"] == replicas
        assert workers["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
        assert workers["spec"]["selector"]["matchLabels"][ROLE_LABEL] == role  # the sets never adopt each other's pods
        config = load_config(WorkerConfig, [], _worker_env(objects, workers))
        assert config.role == role
        assert config.kv_transfer_timeout_s == 90  # config.KV_TRANSFER_TIMEOUT_S
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    assert load_config(SchedulerConfig, [], container_env(objects, scheduler)).kv_transfer_timeout_s == 90
    # Nothing about roles for the scheduler: it reads each worker's from Describe.
    assert not {"STORMSERVE_ROLE", "STORMSERVE_KV_TRANSFER_HOST"} & set(container_env(objects, scheduler))


def test_each_worker_offers_its_pod_ip_to_the_transfer_engines():
    objects = rendered("disaggregated")
    for workers in _pools(objects).values():
        (container,) = workers["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        # Kubernetes expands $(POD_IP) only from a variable defined before it in the list.
        names = [e["name"] for e in container["env"]]
        assert names.index("POD_IP") < names.index("STORMSERVE_KV_TRANSFER_HOST")
        assert env["STORMSERVE_KV_TRANSFER_HOST"]["value"] == "$(POD_IP)"
        assert env["STORMSERVE_HOST"]["value"] == "0.0.0.0"  # the worker's own fallback would read POD_IP too
    # An address of the operator's (a second network, say) stands instead of the pod's IP.
    values = copy.deepcopy(ON)
    values["worker"]["disaggregation"]["decode"] = {"replicas": 1, "env": {"KV_TRANSFER_HOST": "192.168.7.2"}}
    objects = render(values)
    decode = _pools(objects)[component("worker-decode")]
    (container,) = decode["spec"]["template"]["spec"]["containers"]
    assert [e["value"] for e in container["env"] if e["name"] == "STORMSERVE_KV_TRANSFER_HOST"] == ["192.168.7.2"]


def test_the_worker_service_the_scheduler_watches_selects_both_pools():
    objects = rendered("disaggregated")
    prefill, decode = _pools(objects).values()
    service = named(objects, "Service", component("worker"))
    assert selects(service, prefill) and selects(service, decode)
    assert prefill["spec"]["serviceName"] == decode["spec"]["serviceName"] == component("worker")
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    assert container_env(objects, scheduler)["STORMSERVE_WORKER_SERVICE"] == component("worker")
    # The metrics Service and the disruption budget cover both pools too.
    assert all(selects(named(objects, "Service", component("worker-metrics")), w) for w in (prefill, decode))
    pdb = named(objects, "PodDisruptionBudget", component("worker"))
    for workers in (prefill, decode):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= \
            workers["spec"]["template"]["metadata"]["labels"].items()
    # Each set's selector picks its own pods alone.
    assert not selects({"spec": {"selector": prefill["spec"]["selector"]["matchLabels"]}}, decode)


def test_a_pool_reads_the_worker_values_with_its_own_on_top():
    objects = rendered("disaggregated")
    prefill, decode = _pools(objects).values()
    defaults = named(rendered("defaults"), "StatefulSet", component("worker"))
    default_resources = defaults["spec"]["template"]["spec"]["containers"][0]["resources"]
    pod = {name: w["spec"]["template"] for name, w in (("prefill", prefill), ("decode", decode))}
    assert pod["prefill"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "8", "memory": "12Gi"}, "limits": {"memory": "16Gi"}}
    assert pod["decode"]["spec"]["containers"][0]["resources"] == default_resources
    assert pod["prefill"]["spec"]["nodeSelector"] == {"pool": "prefill"}
    assert "nodeSelector" not in pod["decode"]["spec"]
    assert pod["prefill"]["metadata"]["annotations"]["pool"] == "prefill"
    assert pod["decode"]["metadata"]["annotations"]["team"] == pod["prefill"]["metadata"]["annotations"]["team"]
    prefill_env, decode_env = _worker_env(objects, prefill), _worker_env(objects, decode)
    assert prefill_env["STORMSERVE_MAX_BATCH_SIZE"] == "8" and decode_env["STORMSERVE_MAX_BATCH_SIZE"] == "64"
    assert prefill_env["STORMSERVE_LOG_LEVEL"] == decode_env["STORMSERVE_LOG_LEVEL"] == "DEBUG"  # worker.env


def test_workers_reach_each_other_on_any_port():
    objects = rendered("disaggregated")
    policy = named(objects, "NetworkPolicy", component("worker"))
    (peers,) = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]  # any port
    (peer,) = peers["from"]
    for workers in _pools(objects).values():
        labels = workers["spec"]["template"]["metadata"]["labels"]
        assert peer["podSelector"]["matchLabels"].items() <= labels.items()  # from either pool ...
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()  # ... to either pool
    # The scheduler still reaches them on gRPC and the step channel alone.
    (grpc,) = [rule for rule in policy["spec"]["ingress"]
               if rule.get("ports") == [{"port": "grpc", "protocol": "TCP"}, {"port": "steps", "protocol": "TCP"}]]
    (scheduler,) = grpc["from"]
    assert scheduler["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"


def test_each_serving_group_has_both_pools_behind_its_own_service():
    objects = rendered("disaggregated-two-groups")
    pools = _pools(objects)
    assert list(pools) == [component(f"worker-{g}-{role}") for g in range(2) for role in ("prefill", "decode")]
    schedulers = [c for _, c, m in containers(objects) if m == "scheduler"]
    for group, scheduler in enumerate(schedulers):
        service = named(objects, "Service", component(f"worker-{group}"))
        assert container_env(objects, scheduler)["STORMSERVE_WORKER_SERVICE"] == service["metadata"]["name"]
        for name, workers in pools.items():
            labels = workers["spec"]["template"]["metadata"]["labels"]
            own = labels[GROUP_LABEL] == str(group)
            assert selects(service, workers) == own, (service["metadata"]["name"], name)
            if own:
                role = labels[ROLE_LABEL]
                assert name == component(f"worker-{group}-{role}")
                assert workers["spec"]["serviceName"] == service["metadata"]["name"]
                assert workers["spec"]["replicas"] == {"prefill": 1, "decode": 2}[role]
                config = load_config(WorkerConfig, [], _worker_env(objects, workers))
                assert (config.role, config.serving_group) == (role, str(group))
    # Worker pods of every group and pool reach each other: one policy for the component.
    (policy,) = [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == component("worker")]
    (peers,) = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    for workers in pools.values():
        assert peers["from"][0]["podSelector"]["matchLabels"].items() <= \
            workers["spec"]["template"]["metadata"]["labels"].items()
    assert "(1 prefill + 2 decode) worker(s)" in notes("disaggregated-two-groups")


def test_a_static_list_names_both_pools_pods():
    objects = rendered("disaggregated-static")
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    addresses = load_config(SchedulerConfig, [], container_env(objects, scheduler)).worker_addresses
    service = component("worker")
    assert list(addresses) == [f"{component('worker-prefill')}-{i}.{service}.{NAMESPACE}.svc:50053" for i in range(2)] \
        + [f"{component('worker-decode')}-0.{service}.{NAMESPACE}.svc:50053"]
    assert named(objects, "Service", service)["spec"]["publishNotReadyAddresses"] is True


def test_off_renders_as_without_it():
    # Pool values change nothing while disaggregation is off: the default render, byte for byte.
    values = {"worker": {"disaggregation": {"enabled": False, "prefill": {"replicas": 4, "env": {"X": "1"}},
                                            "decode": {"replicas": 7, "nodeSelector": {"a": "b"}}}}}
    assert render_files(values) == render_files({})
    objects = rendered("defaults")
    assert list(_pools(objects)) == [component("worker")]
    for workload in workloads(objects):
        assert ROLE_LABEL not in workload["spec"]["template"]["metadata"]["labels"]
    for _, container, module in containers(objects):
        assert not {"STORMSERVE_ROLE", "STORMSERVE_KV_TRANSFER_HOST", "POD_IP"} & {e["name"] for e in container["env"]}
    assert "prefill" not in notes("defaults")


@pytest.mark.parametrize(("values", "message"), [
    ({"worker": {"nodes": 2, "disaggregation": {"enabled": True}}},
     "worker.disaggregation.enabled with worker.nodes > 1 (2)"),
    ({"worker": {"tensorParallelSize": 4, "disaggregation": {"enabled": True}}},
     "worker.disaggregation.enabled with worker.tensorParallelSize > 1 (4)"),
    ({"worker": {"env": {"ROLE": "prefill"}}}, "worker.env.ROLE is set by the chart"),
    ({"worker": {"disaggregation": {"enabled": True, "decode": {"replicas": 1, "env": {"ROLE": "both"}}}}},
     "worker.disaggregation.decode.env.ROLE is set by the chart"),
    ({"config": {"ROLE": "decode"}}, "config.ROLE is set by the chart"),
    ({"config": {"KV_TRANSFER_HOST": "10.0.0.1"}}, "config.KV_TRANSFER_HOST is set by the chart"),
])
def test_what_cannot_work_fails_the_render_clearly(values, message):
    assert message in _refused(values)


@pytest.mark.parametrize(("values", "message"), [
    ({"worker": {"disaggregation": {"enabled": True, "prefil": {"replicas": 1}}}},
     "at '/worker/disaggregation': additional properties 'prefil' not allowed"),
    ({"worker": {"disaggregation": {"decode": {"replicas": -1}}}}, "at '/worker/disaggregation/decode/replicas'"),
    ({"worker": {"disaggregation": {"prefill": {"replicas": 1, "cpu": 4}}}},
     "at '/worker/disaggregation/prefill': additional properties 'cpu' not allowed"),
])
def test_the_schema_refuses_bad_pools(values, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(refused.value)


def test_the_value_sets_here_are_linted_and_validated():
    assert {"disaggregated", "disaggregated-two-groups", "disaggregated-static"} <= set(VALUE_SETS)
