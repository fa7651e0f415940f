"""The Helm chart in deploy/k8s, rendered and linted by a real Helm v4 engine (the
`helm-python-sdk` wheel, no helm binary) for several value sets, every rendered
object validated strictly against the Kubernetes 1.29 and 1.37 API schemas
(`kubernetes-validate`), and the properties that matter checked against the code:
the settings the pods get are fields of the services' configs, probes name ports
the containers open and gRPC services the processes register, the scheduler's
Role allows exactly what discovery needs."""
from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import re

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from services.common import tracing
from services.common.config import load_config
from services.envoy.config import EnvoyConfig
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig
from tests.chart import CHART, NAMESPACE, RELEASE, ROOT, named, of_kind, render, render_files, workloads

KUBE_VERSIONS = ("1.29", "1.37")

# Custom resources the value sets render on purpose: no Kubernetes schema knows
# them, so they are skipped by name; any other kind without a schema fails.
CUSTOM_RESOURCES = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor")}

VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "npu-8-workers": {
        "worker": {"accelerator": "npu", "replicas": 8, "image": {"repository": "registry.example/stormserve-npu"},
                   "nodeSelector": {"accelerator": "huawei-Ascend910"},
                   "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]},
        "model": {"source": "pvc", "pvc": {"claimName": "qwen3-8b"}, "path": "Qwen3-8B", "name": "Qwen3-8B"},
        "config": {"MAX_PREFILL_TOKENS": "8192"},
    },
    "cuda": {
        "worker": {"accelerator": "cuda", "replicas": 2, "acceleratorResource": {"name": "", "count": 2},
                   "drainTimeoutSeconds": 300,
                   "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                       "nodeSelectorTerms": [{"matchExpressions": [
                           {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]}}}},
        "model": {"source": "hostPath", "hostPath": {"path": "/data/models/smollm2.gguf", "type": "File"}},
        "apiKeys": {"keys": ["key-one", "key-two"]},
        "edge": {"service": {"type": "LoadBalancer"}},
    },
    "existing-secret": {"apiKeys": {"existingSecret": "stormserve-keys", "existingSecretKey": "keys"}},
    "autoscaling-off": {
        "edge": {"autoscaling": {"enabled": False}, "replicas": 3},
        "tokenizer": {"autoscaling": {"enabled": False}, "replicas": 2, "pdb": {"enabled": False}},
        "networkPolicy": {"enabled": False},
    },
    "static-workers": {"scheduler": {"workerDiscovery": "static"}, "worker": {"replicas": 3}},
    "custom-metrics": {
        "edge": {"autoscaling": {"metrics": [{"type": "Pods", "pods": {
            "metric": {"name": "http_requests_in_flight"}, "target": {"type": "AverageValue", "averageValue": "32"}}}]}},
        "tokenizer": {"autoscaling": {"enabled": False}},
        "extraObjects": [{
            "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": "{{ .Release.Name }}-tokenizer"},
            "spec": {"scaleTargetRef": {"name": "{{ .Release.Name }}-stormserve-tokenizer"},
                     "triggers": [{"type": "cpu", "metricType": "Utilization", "metadata": {"value": "60"}}]}}],
        "networkPolicy": {"edgeFrom": [{"namespaceSelector": {"matchLabels": {"ingress": "true"}}}]},
    },
    "metrics": {
        "metrics": {"enabled": True, "port": 9400,
                    "scrapeFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
                    "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}}},
        "tracing": {"otlpEndpoint": "http://otel-collector.observability:4317"},
        "networkPolicy": {"edgeFrom": [{"namespaceSelector": {"matchLabels": {"ingress": "true"}}}]},
    },
    "envoy": {
        "envoy": {"enabled": True, "service": {"type": "LoadBalancer"},
                  "tls": {"secretName": "stormserve-tls", "clientCASecretName": "stormserve-client-ca"}},
        "networkPolicy": {"edgeFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
        "config": {"MAX_REQUEST_MIB": "8", "REQUEST_TIMEOUT_S": "300"},
    },
}

# Each service's config, by the module a container runs (`python -m services.<module>`).
CONFIGS = {"http_edge": EdgeConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
           "worker": WorkerConfig, "envoy": EnvoyConfig}

def process_settings() -> set[str]:
    """STORMSERVE_* variables the services read outside their configs (os.environ),
    found in the source; the supervisor's own (make run's) do not count."""
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        if path.name != "supervisor.py":
            names |= set(re.findall(r"environ(?:\.get)?\(\s*[\"'](STORMSERVE_[A-Z0-9_]+)", path.read_text()))
    return names


def field_env_names(config: type) -> set[str]:
    return {"STORMSERVE_" + f.name.upper() for f in dataclasses.fields(config)}


def registered_grpc_services(module: str) -> set[str]:
    """The names a service's health service answers for: "" and the full name of
    every service its __main__ registers (services/common/grpc_server.py)."""
    source = (ROOT / "services" / module / "__main__.py").read_text()
    packages = dict((alias, pkg) for pkg, alias in re.findall(r"from (stormserve\.\w+\.v1) import (\w+_pb2)\b", source))
    names = {""}
    for alias, service in re.findall(r"(\w+_pb2)\.DESCRIPTOR\.services_by_name\[\"(\w+)\"\]", source):
        pb2 = __import__(f"{packages[alias]}.{alias}", fromlist=[alias])
        names.add(pb2.DESCRIPTOR.services_by_name[service].full_name)
    return names


@functools.cache
def rendered(value_set: str) -> tuple[dict, ...]:
    return render(VALUE_SETS[value_set])


@functools.cache
def notes(value_set: str) -> str:
    return next(text for path, text in render_files(VALUE_SETS[value_set]).items() if path.endswith("NOTES.txt"))


def containers(objects):
    """(workload, container, the module it runs) for every container."""
    for w in workloads(objects):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["command"][:3] == ["python", "-m", c["command"][2]] and c["command"][2].startswith("services.")
            yield w, c, c["command"][2].removeprefix("services.")


def container_env(objects, container) -> dict[str, str]:
    """What the process sees: its ConfigMaps (envFrom), then its own env; a Secret
    reference reads as a placeholder key."""
    env = {}
    for source in container.get("envFrom", []):
        env |= named(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else "placeholder-key"
    return env


def component(name: str) -> str:
    return f"{RELEASE}-stormserve-{name}"


@pytest.fixture(scope="module", autouse=True)
def cached_schemas():
    """kubernetes-validate reads its 1.8 MB definitions file on every call: read each once."""
    original = kubernetes_validate.utils.schema_contents
    kubernetes_validate.utils.schema_contents = functools.cache(original)
    yield
    kubernetes_validate.utils.schema_contents = original


# ---- rendering, lint and API validation ------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_strict(value_set):
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[value_set]), strict=True, namespace=NAMESPACE,
                           kube_version=f"v{version}.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, problems


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_object_validates_strictly(value_set, version):
    skipped = set()
    for obj in rendered(value_set):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            key = (obj["apiVersion"], obj["kind"])
            assert key in CUSTOM_RESOURCES, f"no schema for {key}: not a Kubernetes {version} kind"
            skipped.add(key)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, exc.path))}: {exc.message}")
    expected = {"custom-metrics": {("keda.sh/v1alpha1", "ScaledObject")},
                "metrics": {("monitoring.coreos.com/v1", "PodMonitor")}}
    assert skipped == expected.get(value_set, set())


def test_the_validation_is_strict():
    deployment = copy.deepcopy(named(rendered("defaults"), "Deployment", component("edge")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37", strict=True)


def test_the_release_holds_what_the_issue_lists():
    objects = rendered("defaults")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for name in ("edge", "tokenizer"):
        assert {("Deployment", component(name)), ("HorizontalPodAutoscaler", component(name)),
                ("PodDisruptionBudget", component(name)), ("Service", component(name))} <= kinds
    assert {("Deployment", component("scheduler")), ("ServiceAccount", component("scheduler")),
            ("Role", component("scheduler")), ("RoleBinding", component("scheduler")),
            ("StatefulSet", component("worker")), ("Service", component("worker")),
            ("ConfigMap", f"{RELEASE}-stormserve-config")} <= kinds
    assert len(of_kind(objects, "NetworkPolicy")) == 4
    assert not of_kind(objects, "Secret")  # no keys given: no Secret, and the edge checks none
    scheduler = named(objects, "Deployment", component("scheduler"))["spec"]
    assert scheduler["replicas"] == 1 and scheduler["strategy"] == {"type": "Recreate"}


BAD_VALUES = [
    ({"worker": {"accelerator": "tpu"}}, "at '/worker/accelerator': value must be one of 'cpu', 'cuda', 'npu'"),
    ({"edge": {"replicaz": 3}}, "at '/edge': additional properties 'replicaz' not allowed"),
    ({"model": {"source": "pvc"}}, "at '/model/pvc/claimName'"),
    ({"model": {"source": "hostPath", "hostPath": {"path": "models"}}}, "at '/model/hostPath/path'"),
    ({"ports": {"worker": 70000}}, "at '/ports/worker': maximum"),
    ({"worker": {"acceleratorResource": {"name": "gpu"}}}, "at '/worker/acceleratorResource/name'"),
    ({"scheduler": {"workerDiscovery": "pods"}}, "at '/scheduler/workerDiscovery'"),
    ({"config": {"max_seq_len": "100"}}, "'max_seq_len' does not match pattern"),
    ({"tracing": {"otlpEndpoint": "otel-collector:4317"}}, "at '/tracing/otlpEndpoint'"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_the_schema_refuses_bad_values_clearly(values, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(refused.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"config": {"MODEL_PATH": "/models/x"}}, "config.MODEL_PATH is set by the chart"),
    ({"apiKeys": {"keys": ["a"], "existingSecret": "s"}}, "apiKeys.keys and apiKeys.existingSecret exclude each other"),
    ({"edge": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
     "edge.autoscaling.minReplicas (5) must not exceed edge.autoscaling.maxReplicas (2)"),
    ({"tokenizer": {"resources": {"requests": {"cpu": None}}}}, "needs tokenizer.resources.requests.cpu"),
])
def test_values_the_schema_cannot_judge_fail_the_render_clearly(values, message):
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmRenderError) as refused:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(refused.value)


# ---- what the pods get is what the code reads ------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_setting_is_a_config_field_of_its_service(value_set):
    objects = rendered(value_set)
    outside_configs = process_settings()
    all_fields = set().union(*map(field_env_names, CONFIGS.values()))
    shared = set().union(*(cm["data"] for cm in of_kind(objects, "ConfigMap")))
    for cm in of_kind(objects, "ConfigMap"):
        for name in cm["data"]:
            assert name in all_fields | outside_configs , \
                f"ConfigMap {cm['metadata']['name']}: {name} is read by no service"
    for workload, container, module in containers(objects):
        fields = field_env_names(CONFIGS[module])
        env = container_env(objects, container)
        for name in env:
            if not name.startswith("STORMSERVE_") or name in shared or name in outside_configs:
                continue
            assert name in fields, \
                f"{workload['metadata']['name']}: {name} is not a setting of services.{module}"
        # The env the process sees builds its config: every value parses and passes its checks.
        try:
            load_config(CONFIGS[module], [], env)
        except SystemExit:
            pytest.fail(f"{workload['metadata']['name']}: services.{module} refuses its environment")


def test_settings_read_outside_the_configs_are_known():
    assert {"STORMSERVE_CACHE_DIR", "STORMSERVE_LOG_LEVEL"} <= process_settings()


def test_settings_reach_the_services():
    objects = rendered("npu-8-workers")
    env = {module: container_env(objects, c) for _, c, module in containers(objects)}
    worker = load_config(WorkerConfig, [], env["worker"])
    assert (worker.host, worker.port, worker.device, worker.model_path) == \
        ("0.0.0.0", 50053, "npu", "/models/Qwen3-8B")
    tokenizer = load_config(TokenizerConfig, [], env["tokenizer"])
    assert (tokenizer.model_path, tokenizer.model_name, tokenizer.scheduler_address) == \
        ("/models/Qwen3-8B", "Qwen3-8B", f"{component('scheduler')}:50052")
    scheduler = load_config(SchedulerConfig, [], env["scheduler"])
    assert (scheduler.port, scheduler.max_prefill_tokens) == (50052, 8192)
    assert env["scheduler"]["STORMSERVE_WORKER_DISCOVERY"] == "endpointslices"
    assert env["scheduler"]["STORMSERVE_WORKER_SERVICE"] == component("worker")
    assert env["scheduler"]["STORMSERVE_WORKER_PORT"] == "50053"
    assert "STORMSERVE_WORKER_NAMESPACE" not in env["scheduler"]  # the pod's own namespace
    assert load_config(EdgeConfig, [], env["http_edge"]).tokenizer_address == f"{component('tokenizer')}:50051"
    for module in env:
        assert env[module]["STORMSERVE_CACHE_DIR"] == "/var/cache/stormserve"


def test_addresses_name_services_and_their_ports():
    for value_set in VALUE_SETS:
        objects = rendered(value_set)
        services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
        for workload, container, module in containers(objects):
            env = container_env(objects, container)
            for name in ("STORMSERVE_TOKENIZER_ADDRESS", "STORMSERVE_SCHEDULER_ADDRESS"):
                if name in env:
                    host, port = env[name].rsplit(":", 1)
                    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], (value_set, name)


def test_api_keys_come_from_the_secret():
    objects = rendered("cuda")
    (secret,) = of_kind(objects, "Secret")
    assert base64.b64decode(secret["data"]["api-keys"]).decode() == "key-one,key-two"
    edge = next(c for _, c, m in containers(objects) if m == "http_edge")
    (item,) = [e for e in edge["env"] if e["name"] == "STORMSERVE_API_KEYS"]
    assert item["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "api-keys"}
    assert load_config(EdgeConfig, [], {"STORMSERVE_API_KEYS": "key-one,key-two"}).api_keys == ("key-one", "key-two")

    objects = rendered("existing-secret")
    assert not of_kind(objects, "Secret")
    edge = next(c for _, c, m in containers(objects) if m == "http_edge")
    (item,) = [e for e in edge["env"] if e["name"] == "STORMSERVE_API_KEYS"]
    assert item["valueFrom"]["secretKeyRef"] == {"name": "stormserve-keys", "key": "keys"}
    assert "Authorization: Bearer" in notes("existing-secret") and "stormserve-keys" in notes("existing-secret")
    for _, c, m in containers(objects):
        if m != "http_edge":
            assert "STORMSERVE_API_KEYS" not in container_env(objects, c)


# ---- probes, drain, security ------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_probes_name_open_ports_and_registered_grpc_services(value_set):
    for workload, container, module in containers(rendered(value_set)):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
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
        assert pod["automountServiceAccountToken"] is (module == "scheduler"
                                                        and "STORMSERVE_WORKER_SERVICE" in env)


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
    (role,) = of_kind(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    (binding,) = of_kind(objects, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    scheduler = named(objects, "Deployment", component("scheduler"))["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": scheduler["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    assert "namespace" not in role["metadata"]  # the release's namespace, given at install


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_scheduler_discovers_the_worker_service(value_set):
    objects = rendered(value_set)
    (workers,) = of_kind(objects, "StatefulSet")
    service = named(objects, "Service", workers["spec"]["serviceName"])
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert workers["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert workers["spec"]["podManagementPolicy"] == "Parallel"
    (port,) = service["spec"]["ports"]
    worker_ports = {p["name"]: p["containerPort"] for p in workers["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert worker_ports[port["targetPort"]] == port["port"]
    scheduler = next(c for _, c, m in containers(objects) if m == "scheduler")
    env = container_env(objects, scheduler)
    if env["STORMSERVE_WORKER_DISCOVERY"] == "endpointslices":
        # EndpointSlices carry kubernetes.io/service-name=<Service name>: the one the scheduler watches.
        assert env["STORMSERVE_WORKER_SERVICE"] == service["metadata"]["name"]
        assert int(env["STORMSERVE_WORKER_PORT"]) == port["port"]
        # Not-ready workers must read as not ready in the slices (drain), never published as ready.
        assert not service["spec"].get("publishNotReadyAddresses")
        assert "STORMSERVE_WORKER_ADDRESSES" not in env
    else:
        addresses = load_config(SchedulerConfig, [], env).worker_addresses
        assert len(addresses) == workers["spec"]["replicas"] == 3
        assert addresses[2] == f"{component('worker')}-2.{component('worker')}.{NAMESPACE}.svc:50053"
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


def test_services_target_ports_their_pods_open():
    for value_set in VALUE_SETS:
        objects = rendered(value_set)
        for service in of_kind(objects, "Service"):
            selected = [w for w in workloads(objects)
                        if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
            assert len(selected) == 1, service["metadata"]["name"]
            ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
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
