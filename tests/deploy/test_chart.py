"""The Helm chart in deploy/k8s, rendered and linted by a real Helm v4 engine (the
`helm-python-sdk` wheel, no helm binary) for several value sets, every rendered
object validated strictly against the Kubernetes 1.29 and 1.37 API schemas
(`kubernetes-validate`; a LeaderWorkerSet against LWS's published schema, its pod
templates strictly as Kubernetes pod templates), and what the pods get checked against the code: every
setting is a field of its service's config and reaches it, addresses name the
services and their ports, API keys come from the Secret. The pods themselves
(probes, discovery, scaling, the network): test_chart_pods.py."""
from __future__ import annotations

import base64
import copy
import functools
import json
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest

from services.common.api_keys import KeyLimits, read_key_file
from services.common.config import load_config
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig
from tests.chart import CHART, NAMESPACE, RELEASE, named, of_kind
from tests.deploy.chart_values import (
    CONFIGS,
    VALUE_SETS,
    component,
    container_env,
    containers,
    field_env_names,
    notes,
    process_settings,
    rendered,
)

KUBE_VERSIONS = ("1.29", "1.37")

# Custom resources the value sets render on purpose: no Kubernetes schema knows
# them, so they are skipped by name; any other kind without a schema fails.
CUSTOM_RESOURCES = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "PodMonitor"),
                    ("cert-manager.io/v1", "Certificate")}


# LeaderWorkerSet (kubernetes-sigs/lws), a custom resource the chart renders for
# worker.nodes > 1: checked against the facts of LWS's published schema (the file says where from).
LEADERWORKERSET_SCHEMA = json.loads((Path(__file__).parent / "leaderworkerset.schema.json").read_text())


def validate_leaderworkerset(obj: dict, version: str) -> None:
    """jsonschema.ValidationError or kubernetes_validate.ValidationError for a
    LeaderWorkerSet that LWS's schema, or Kubernetes' for its pod templates, refuses."""
    jsonschema.Draft202012Validator(LEADERWORKERSET_SCHEMA).validate(obj)
    templates = obj["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        if role in templates:
            name = f"{obj['metadata']['name']}-{role.lower()}"
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                            "template": templates[role]}
            kubernetes_validate.validate(pod_template, version, strict=True)


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
    skipped, leaderworkersets = set(), 0
    for obj in rendered(value_set):
        try:
            if (obj["apiVersion"], obj["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
                validate_leaderworkerset(obj, version)  # no Kubernetes schema knows it
                leaderworkersets += 1
                continue
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            key = (obj["apiVersion"], obj["kind"])
            assert key in CUSTOM_RESOURCES, f"no schema for {key}: not a Kubernetes {version} kind"
            skipped.add(key)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, exc.path))}: {exc.message}")
    assert leaderworkersets == (VALUE_SETS[value_set].get("worker", {}).get("nodes", 1) > 1)
    expected = {"custom-metrics": {("keda.sh/v1alpha1", "ScaledObject")},
                "metrics": {("monitoring.coreos.com/v1", "PodMonitor")},
                "internal-tls-cert-manager": {("monitoring.coreos.com/v1", "PodMonitor"),
                                              ("cert-manager.io/v1", "Certificate")}}
    assert skipped == expected.get(value_set, set())


def test_the_validation_is_strict():
    deployment = copy.deepcopy(named(rendered("defaults"), "Deployment", component("edge")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37", strict=True)


@pytest.mark.parametrize(("path", "value"), [
    (("leaderWorkerTemplate", "restartPolicy"), "RecreateGroup"),
    (("leaderWorkerTemplate", "size"), 0),
    (("leaderWorkerTemplate", "sise"), 2),
    (("startupPolicy",), "LeaderStarted"),
    (("leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "readynessProbe"), {}),
])
def test_the_leaderworkerset_validation_is_strict(path, value):
    lws = copy.deepcopy(of_kind(rendered("multi-node"), "LeaderWorkerSet")[0])
    validate_leaderworkerset(lws, "1.37")
    where = lws["spec"]
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_leaderworkerset(lws, "1.37")


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
    ({"apiKeys": {"keys": ["a,b"]}}, "at '/apiKeys/keys/0'"),
    ({"apiKeys": {"keys": [{"name": "team-a"}]}}, "at '/apiKeys/keys/0'"),
    ({"apiKeys": {"keys": [{"key": "k", "maxConcurrent": -1}]}}, "at '/apiKeys/keys/0'"),
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


def test_api_keys_come_from_the_secret_as_a_key_file_both_doors_read(tmp_path):
    objects = rendered("cuda")
    (secret,) = of_kind(objects, "Secret")
    key_file = base64.b64decode(secret["data"]["api-keys"]).decode()
    assert key_file == ("key-one\nkey-two name=team-b requests_per_second=2.5 max_concurrent=4 "
                        "tokens_per_minute=60000\n")
    (tmp_path / "api-keys").write_text(key_file)
    keys = {k.name: k.limits for k in read_key_file(str(tmp_path / "api-keys"))}
    assert keys["team-b"] == KeyLimits(2.5, 4, 60000) and len(keys) == 2
    for value_set, secret_name, secret_key in (("cuda", secret["metadata"]["name"], "api-keys"),
                                               ("existing-secret", "stormserve-keys", "keys")):
        objects = rendered(value_set)
        for workload, container, module in containers(objects):
            env = container_env(objects, container)
            if module not in ("http_edge", "tokenizer"):
                assert "STORMSERVE_API_KEY_FILE" not in env and "STORMSERVE_API_KEYS" not in env
                continue
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
            (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-keys"]
            assert volume["secret"]["secretName"] == secret_name
            assert env["STORMSERVE_API_KEY_FILE"] == f"{mount['mountPath']}/{secret_key}"
    assert not of_kind(rendered("existing-secret"), "Secret")
    assert "Authorization: Bearer" in notes("existing-secret") and "stormserve-keys" in notes("existing-secret")
