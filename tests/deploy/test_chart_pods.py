"""The chart's pods, rendered by the real Helm engine for several value sets
(tests/deploy/chart_values.py): probes, drain and security; the scheduler's
discovery of workers, model sources and accelerators; scaling, disruption
budgets, the network; metrics and traces."""
from __future__ import annotations

import helm_python as helm
import pytest
import yaml

from services.common import tracing
from services.common.config import load_config
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tests.chart import CHART, NAMESPACE, RELEASE, named, of_kind, selects, workloads
from tests.deploy.chart_values import (
    CONFIGS,
    VALUE_SETS,
    component,
    container_env,
    containers,
    notes,
    registered_grpc_services,
    rendered,
)

# ---- probes, drain, security ------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_probes_name_open_ports_and_registered_grpc_services(value_set):
    for workload, container, module in containers(rendered(value_set)):
        probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
        if module == "worker.follower":  # a follower pod serves nothing: it exits when its group cannot go on
            assert not probes and not container.get("ports")
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert {"readinessProbe", "livenessProbe"} <= set(probes)
        for kind, probe in probes.items():
            (handler,) = [k for k in ("grpc", "httpGet", "tcpSocket", "exec") if k in probe]
            where = f"{workload['metadata']['name']} {kind}"
            if handler == "grpc":
                assert probe["grpc"]["port"] in ports.values(), where
                assert probe["grpc"]["service"] in registered_grpc_services(module), where
            elif handler in ("httpGet", "tcpSocket"):
                port = probe[handler]["port"]
                assert port in ports or port in ports.values(), where
            else:
                pytest.fail(f"{where}: exec probe")
        # The edge is ready when /health says so; the gRPC services when their health says so.
        ready = probes["readinessProbe"]
        if module == "http_edge":
            assert ready["httpGet"]["path"] == "/health"
        elif module == "envoy":  # mutual TLS would refuse the kubelet, which has no client certificate
            assert set(ready) >= {"tcpSocket"}
        else:
            assert ready["grpc"]["service"] != ""
        # The port the process listens on is the one the probes and Services use.
        port = "STORMSERVE_ENVOY_PORT" if module == "envoy" else "STORMSERVE_PORT"
        assert int(container_env(rendered(value_set), container)[port]) in ports.values()


def test_the_health_names_the_probes_use_exist():
    assert registered_grpc_services("worker") == {"", "stormserve.worker.v1.WorkerService"}
    assert "stormserve.chat.v1.ChatService" in registered_grpc_services("tokenizer")
    assert registered_grpc_services("scheduler") == {"", "stormserve.scheduler.v1.SchedulerService"}


def test_workers_have_a_long_startup_probe():
    (worker,) = of_kind(rendered("defaults"), "StatefulSet")
    probe = worker["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["grpc"]["service"] == "stormserve.worker.v1.WorkerService"
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_termination_grace_covers_pre_stop_and_drain(value_set):
    objects = rendered(value_set)
    for workload, container, module in containers(objects):
        pod = workload["spec"]["template"]["spec"]
        words = " ".join(container["lifecycle"]["preStop"]["exec"]["command"]).split()
        sleep = int(words[words.index("sleep") + 1])
        assert sleep > 0
        drain = float(container_env(objects, container)["STORMSERVE_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] >= sleep + drain + 5, workload["metadata"]["name"]
    (worker,) = of_kind(rendered("cuda"), "StatefulSet")
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 5 + 300 + 10


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_run_as_non_root_on_a_read_only_root(value_set):
    objects = rendered(value_set)
    for workload, container, module in containers(objects):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        # Where the code writes is an emptyDir: STORMSERVE_CACHE_DIR (converted models,
        # compiled kernels), /tmp (compiler scratch) and HOME.
        env = container_env(objects, container)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for path in (env["STORMSERVE_CACHE_DIR"], "/tmp", env["HOME"]):
            assert "emptyDir" in volumes[mounts[path]], (workload["metadata"]["name"], path)
        # Only the pods that watch EndpointSlices get a token: schedulers (workers), tokenizers (schedulers).
        assert pod["automountServiceAccountToken"] is ((module == "scheduler" and "STORMSERVE_WORKER_SERVICE" in env)
                                                       or (module == "tokenizer"
                                                           and "STORMSERVE_SCHEDULER_SERVICE" in env))


def test_model_sources():
    for value_set, source in (("defaults", None), ("npu-8-workers", "persistentVolumeClaim"), ("cuda", "hostPath")):
        objects = rendered(value_set)
        for workload, container, module in containers(objects):
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            env = container_env(objects, container)
            if module in ("tokenizer", "worker") and source:
                assert source in volumes["model"]
                mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
                assert mount["readOnly"] is True and env["STORMSERVE_MODEL_PATH"].startswith(mount["mountPath"])
            else:
                assert "model" not in volumes  # the edge and the scheduler never read the model
            if not source:
                assert "STORMSERVE_MODEL_PATH" not in env  # empty = the bundled model
    (worker,) = of_kind(rendered("cuda"), "StatefulSet")
    assert container_env(rendered("cuda"), worker["spec"]["template"]["spec"]["containers"][0])[
        "STORMSERVE_MODEL_PATH"] == "/models"


# ---- scheduler, workers and discovery ----------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_scheduler_may_only_read_endpointslices(value_set):
    objects = rendered(value_set)
    static = VALUE_SETS[value_set].get("scheduler", {}).get("workerDiscovery") == "static"
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    if static:
        assert not of_kind(objects, "Role") and not of_kind(objects, "RoleBinding")
        return
    schedulers = [d for d in of_kind(objects, "Deployment")
                  if d["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"]
    roles, bindings = ([o for o in of_kind(objects, kind) if o["metadata"]["labels"]["app.kubernetes.io/component"]
                        == "scheduler"] for kind in ("Role", "RoleBinding"))  # the tokenizers': test_chart_groups
    assert len(roles) == len(bindings) == len(schedulers)  # one scheduler per serving group
    for role, binding in zip(roles, bindings):
        assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                                  "verbs": ["get", "list", "watch"]}]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        scheduler = named(objects, "Deployment", role["metadata"]["name"])["spec"]["template"]["spec"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": scheduler["serviceAccountName"],
                                        "namespace": NAMESPACE}]
        assert "namespace" not in role["metadata"]  # the release's namespace, given at install


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_scheduler_discovers_the_worker_service(value_set):
    objects = rendered(value_set)
    if of_kind(objects, "LeaderWorkerSet"):
        return  # test_a_worker_that_spans_pods_is_a_leaderworkerset
    # One scheduler and one worker Service per serving group, in group order; the checks pair them.
    # Behind each Service, one StatefulSet, or with worker.disaggregation a prefill and a decode pool.
    schedulers = [c for _, c, m in containers(objects) if m == "scheduler"]
    worker_sets = of_kind(objects, "StatefulSet")
    services = list(dict.fromkeys(s["spec"]["serviceName"] for s in worker_sets))
    assert len(schedulers) == len(services)
    for scheduler, service in zip(schedulers, services):
        _check_discovery(objects, scheduler, [s for s in worker_sets if s["spec"]["serviceName"] == service])


def _check_discovery(objects, scheduler, worker_sets) -> None:
    (service,) = {s["spec"]["serviceName"] for s in worker_sets}
    service = named(objects, "Service", service)
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    for workers in worker_sets:
        pod_labels = workers["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert workers["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert workers["spec"]["podManagementPolicy"] == "Parallel"
        worker = workers["spec"]["template"]["spec"]["containers"][0]
        worker_ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
        assert worker_ports[port["targetPort"]] == port["port"]
    env = container_env(objects, scheduler)
    if env["STORMSERVE_WORKER_DISCOVERY"] == "endpointslices":
        # EndpointSlices carry kubernetes.io/service-name=<Service name>: the one the scheduler watches.
        assert env["STORMSERVE_WORKER_SERVICE"] == service["metadata"]["name"]
        assert int(env["STORMSERVE_WORKER_PORT"]) == port["port"]
        # Not-ready workers must read as not ready in the slices (drain), never published as ready.
        assert not service["spec"].get("publishNotReadyAddresses")
        assert "STORMSERVE_WORKER_ADDRESSES" not in env
    else:
        # Every pod of every set, by its name under the worker Service, set after set.
        addresses = load_config(SchedulerConfig, [], env).worker_addresses
        expected = [f"{w['metadata']['name']}-{i}.{service['metadata']['name']}.{NAMESPACE}.svc:50053"
                    for w in worker_sets for i in range(w["spec"]["replicas"])]
        assert list(addresses) == expected
        assert service["spec"]["publishNotReadyAddresses"] is True


def test_accelerators():
    def worker_container(value_set):
        (workers,) = of_kind(rendered(value_set), "StatefulSet")
        return workers, workers["spec"]["template"]["spec"]["containers"][0]

    workers, c = worker_container("npu-8-workers")
    assert workers["spec"]["replicas"] == 8
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == c["resources"]["requests"]["huawei.com/Ascend910"] == 1
    assert c["image"] == "registry.example/stormserve-npu:0.1.0"
    pod = workers["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    assert pod["tolerations"][0]["key"] == "huawei.com/Ascend910"
    assert load_config(WorkerConfig, [], container_env(rendered("npu-8-workers"), c)).device == "npu"

    workers, c = worker_container("cuda")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert "nodeAffinity" in workers["spec"]["template"]["spec"]["affinity"]
    assert load_config(WorkerConfig, [], container_env(rendered("cuda"), c)).device == "cuda"

    workers, c = worker_container("defaults")
    assert not [r for r in c["resources"]["limits"] if "/" in r]
    assert load_config(WorkerConfig, [], container_env(rendered("defaults"), c)).device == "cpu"

    with helm.Chart.load(CHART) as chart:
        text = chart.render({"worker": {"accelerator": "npu", "acceleratorResource": {
            "name": "huawei.com/Ascend310P", "count": 4}}}, name=RELEASE, namespace=NAMESPACE)
    (workers,) = [o for path, t in text.items() if path.endswith(".yaml") for o in yaml.safe_load_all(t)
                  if o and o.get("kind") == "StatefulSet"]
    limits = workers["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["huawei.com/Ascend310P"] == 4 and "huawei.com/Ascend910" not in limits

    # A tensor-parallel worker: one device per rank, the ranks in the worker's config.
    with helm.Chart.load(CHART) as chart:
        text = chart.render({"worker": {"accelerator": "npu", "tensorParallelSize": 8}}, name=RELEASE,
                            namespace=NAMESPACE)
    objects = [o for path, t in text.items() if path.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    (workers,) = [o for o in objects if o.get("kind") == "StatefulSet"]
    c = workers["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == c["resources"]["requests"]["huawei.com/Ascend910"] == 8
    assert load_config(WorkerConfig, [], container_env(objects, c)).tensor_parallel_size == 8


# ---- scaling, disruption, network -------------------------------------------


def test_autoscaling_and_disruption_budgets():
    objects = rendered("defaults")
    for name in ("edge", "tokenizer"):
        hpa = named(objects, "HorizontalPodAutoscaler", component(name))["spec"]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": component(name)}
        assert hpa["metrics"][0]["resource"]["name"] == "cpu"
        assert "replicas" not in named(objects, "Deployment", component(name))["spec"]  # the HPA owns it
        assert named(objects, "PodDisruptionBudget", component(name))["spec"]["maxUnavailable"] == 1
    objects = rendered("autoscaling-off")
    assert not of_kind(objects, "HorizontalPodAutoscaler")
    assert named(objects, "Deployment", component("edge"))["spec"]["replicas"] == 3
    assert {p["metadata"]["name"] for p in of_kind(objects, "PodDisruptionBudget")} == \
        {component("edge"), component("worker")}
    objects = rendered("custom-metrics")
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["type"] == "Pods"
    (scaled,) = of_kind(objects, "ScaledObject")
    assert scaled["metadata"]["name"] == f"{RELEASE}-tokenizer"  # values pass through tpl
    assert scaled["spec"]["scaleTargetRef"]["name"] == component("tokenizer")


@pytest.mark.parametrize("value_set", ["defaults", "custom-metrics"])
def test_only_the_edge_is_reachable_from_outside_the_release(value_set):
    objects = rendered(value_set)
    policies = of_kind(objects, "NetworkPolicy")
    by_component = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p for p in policies}
    assert set(by_component) == {"edge", "tokenizer", "scheduler", "worker"}
    for w in workloads(objects):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(p["spec"]["podSelector"]["matchLabels"].items() <= labels.items() for p in policies)
    (edge_rule,) = by_component["edge"]["spec"]["ingress"]
    assert edge_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert edge_rule.get("from", []) == VALUE_SETS[value_set].get("networkPolicy", {}).get("edgeFrom", [])
    for to, source in (("tokenizer", "edge"), ("scheduler", "tokenizer"), ("worker", "scheduler")):
        (rule,) = by_component[to]["spec"]["ingress"]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # pods of this namespace only
        assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "stormserve",
                                                      "app.kubernetes.io/instance": RELEASE,
                                                      "app.kubernetes.io/component": source}
        assert by_component[to]["spec"]["policyTypes"] == ["Ingress"]
        # gRPC, and to workers their step channel: the port the worker serves it on (STORMSERVE_STEP_PORT).
        assert [p["port"] for p in rule["ports"]] == ["grpc", "steps"] if to == "worker" else ["grpc"]
    for _, container, module in containers(objects):
        if module == "worker":
            (steps,) = [p for p in container["ports"] if p["name"] == "steps"]
            assert container_env(objects, container)["STORMSERVE_STEP_PORT"] == str(steps["containerPort"])


def test_services_target_ports_their_pods_open():
    for value_set in VALUE_SETS:
        objects = rendered(value_set)
        for service in of_kind(objects, "Service"):
            selected = [w for w in workloads(objects)
                        if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            # One workload each, but the schedulers' Service, which lists every serving group's scheduler,
            # and with worker.disaggregation the worker Services, which list a prefill and a decode pool.
            pools = {w["spec"]["template"]["metadata"]["labels"].get("stormserve.io/role") for w in selected}
            assert len(selected) == 1 or service["metadata"]["name"] == f"{RELEASE}-stormserve-schedulers" \
                or (len(selected) == 2 and pools == {"prefill", "decode"}), service["metadata"]["name"]
            for workload in selected:
                ports = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
                for port in service["spec"]["ports"]:
                    assert port["targetPort"] in ports


def test_notes_tell_how_to_call_it():
    text = notes("defaults")
    assert f"port-forward service/{component('edge')} 8000:8000" in text
    assert "/v1/chat/completions" in text and '"model": "SmolLM2-135M-Instruct"' in text
    assert "Authorization" not in text
    assert "jsonpath='{.status.loadBalancer.ingress[0].ip}'" in notes("cuda")


def test_metrics_ports_monitors_and_who_may_scrape():
    objects = rendered("metrics")
    for workload, container, module in containers(objects):
        env = container_env(objects, container)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if module == "http_edge":  # /metrics on its http port
            assert "STORMSERVE_METRICS_PORT" not in env and "metrics" not in ports
        else:
            assert env["STORMSERVE_METRICS_PORT"] == "9400" and ports["metrics"] == 9400
            assert load_config(CONFIGS[module], [], env).metrics_port == 9400
    metrics_port = {"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}
    for name in ("tokenizer", "scheduler"):
        assert metrics_port in named(objects, "Service", component(name))["spec"]["ports"]
    # The worker Service's EndpointSlices are what the scheduler watches: they keep the gRPC port alone.
    assert [p["name"] for p in named(objects, "Service", component("worker"))["spec"]["ports"]] == ["grpc"]
    assert named(objects, "Service", component("worker") + "-metrics")["spec"]["ports"] == [metrics_port]
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
                for p in of_kind(objects, "NetworkPolicy")}
    scrapers = VALUE_SETS["metrics"]["metrics"]["scrapeFrom"]
    for name, port in (("edge", "http"), ("tokenizer", "metrics"), ("scheduler", "metrics"), ("worker", "metrics")):
        rule = policies[name]["spec"]["ingress"][-1]
        assert rule == {"ports": [{"port": port, "protocol": "TCP"}], "from": scrapers}
    # What the monitors select: tests/deploy/test_chart_monitors.py.
    (pod_monitor,) = of_kind(objects, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert not of_kind(objects, "ServiceMonitor")
    # Off by default: no metrics port, no monitor, the policies unchanged.
    defaults = rendered("defaults")
    assert not of_kind(defaults, "PodMonitor") and not of_kind(defaults, "ServiceMonitor")
    assert all("metrics" not in {p["name"] for p in c["ports"]} for _, c, _ in containers(defaults))


def test_tracing_reaches_every_service_when_a_collector_is_named():
    for _, container, module in containers(rendered("metrics")):
        env = container_env(rendered("metrics"), container)
        assert tracing.configured(env), module
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true"
        assert env["OTEL_SERVICE_NAME"] == "stormserve-" + {"http_edge": "edge"}.get(module, module)
    for _, container, module in containers(rendered("defaults")):
        assert not tracing.configured(container_env(rendered("defaults"), container)), module


# ---- a worker that spans pods (LeaderWorkerSet) -------------------------------


def test_a_worker_that_spans_pods_is_a_leaderworkerset():
    objects = rendered("multi-node")
    assert not of_kind(objects, "StatefulSet")
    (lws,) = of_kind(objects, "LeaderWorkerSet")
    spec, template = lws["spec"], lws["spec"]["leaderWorkerTemplate"]
    assert (spec["replicas"], template["size"]) == (2, 2)
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a pod that dies restarts its group
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once the others joined
    # LeaderWorkerSet makes a headless Service of its own name for LWS_LEADER_ADDRESS (publishing
    # pods not yet ready): it must not be the worker Service, which lists ready leaders alone.
    service = named(objects, "Service", component("worker"))
    assert lws["metadata"]["name"] != service["metadata"]["name"]
    leader, follower = (w for w in workloads(objects) if w["kind"] == "LeaderWorkerSet")
    assert (leader["spec"]["replicas"], follower["spec"]["replicas"]) == (2, 2)
    by_module = {module: (w, c) for w, c, module in containers(objects) if module.startswith("worker")}
    assert by_module["worker"][0] == leader and by_module["worker.follower"][0] == follower
    # Every pod holds 8 of the worker's 16 ranks, one device each; all agree on where they meet.
    configs = {module: load_config(WorkerConfig, [], container_env(objects, c))
               for module, (_, c) in by_module.items()}
    for module, (_, c) in by_module.items():
        resources = c["resources"]
        assert resources["limits"]["huawei.com/Ascend910"] == resources["requests"]["huawei.com/Ascend910"] == 8
        assert (configs[module].tensor_parallel_size, configs[module].device) == (16, "npu")
        assert configs[module].group_port == configs["worker"].group_port
    leader_ports = {p["name"]: p["containerPort"] for p in by_module["worker"][1]["ports"]}
    assert (leader_ports["group-store"], leader_ports["group-steps"]) == (configs["worker"].group_port,
                                                                          configs["worker"].group_port + 1)
    # Only leaders are in the Services: LeaderWorkerSet labels a group's pods worker-index 0 (the
    # leader, which runs rank 0 and serves WorkerService) to size - 1.
    for name in ("worker", "worker-metrics"):
        service = named(objects, "Service", component(name))
        assert selects(service, leader) and not selects(service, follower)
        pod_labels = {**follower["spec"]["template"]["metadata"]["labels"],
                      "leaderworkerset.sigs.k8s.io/worker-index": "1"}  # as LeaderWorkerSet labels the pod
        assert not service["spec"]["selector"].items() <= pod_labels.items()
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    assert container_env(objects, scheduler)["STORMSERVE_WORKER_SERVICE"] == component("worker")
    # The ranks reach each other (rank 0's ports and the collectives' own).
    policy = named(objects, "NetworkPolicy", component("worker"))
    (peers,) = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    (peer,) = peers["from"]
    for pods in (leader, follower):
        assert peer["podSelector"]["matchLabels"].items() <= pods["spec"]["template"]["metadata"]["labels"].items()
    assert not [r for r in named(rendered("defaults"), "NetworkPolicy", component("worker"))["spec"]["ingress"]
                if "ports" not in r]  # one-pod workers: the scheduler's gRPC alone, as before


def test_static_discovery_names_the_leader_pods():
    with helm.Chart.load(CHART) as chart:
        text = chart.render({"worker": {"nodes": 4, "replicas": 2}, "scheduler": {"workerDiscovery": "static"}},
                            name=RELEASE, namespace=NAMESPACE)
    objects = [o for path, t in text.items() if path.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    (lws,) = of_kind(objects, "LeaderWorkerSet")
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    addresses = load_config(SchedulerConfig, [], container_env(objects, scheduler)).worker_addresses
    name = lws["metadata"]["name"]  # leader pods <lws>-<group>, under LeaderWorkerSet's own headless Service
    assert list(addresses) == [f"{name}-{i}.{name}.{NAMESPACE}.svc:50053" for i in range(2)]
