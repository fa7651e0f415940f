"""The value sets the chart tests render, and what they read off the rendered
objects: each container's module and environment, the settings the services
read, the gRPC services they register."""
from __future__ import annotations

import dataclasses
import functools
import re

from services.envoy.config import EnvoyConfig
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig
from tests.chart import RELEASE, ROOT, named, render, render_files, workloads

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
        "apiKeys": {"keys": ["key-one", {"key": "key-two", "name": "team-b", "requestsPerSecond": 2.5,
                                          "maxConcurrent": 4, "tokensPerMinute": 60000}]},
        "edge": {"service": {"type": "LoadBalancer"}},
    },
    "existing-secret": {"apiKeys": {"existingSecret": "stormserve-keys", "existingSecretKey": "keys"}},
    "autoscaling-off": {
        "edge": {"autoscaling": {"enabled": False}, "replicas": 3},
        "tokenizer": {"autoscaling": {"enabled": False}, "replicas": 2, "pdb": {"enabled": False}},
        "networkPolicy": {"enabled": False},
    },
    "static-workers": {"scheduler": {"workerDiscovery": "static"}, "worker": {"replicas": 3}},
    "two-groups": {"scheduler": {"groups": 2}, "worker": {"replicas": 2}},
    "two-groups-static": {"scheduler": {"groups": 2, "workerDiscovery": "static"},
                          "tokenizer": {"schedulerDiscovery": "static"}},
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
    # Internal mutual TLS (tests/deploy/test_chart_internal_tls.py): from an operator's Secret,
    # Envoy in front; and from cert-manager, with metrics scraped over it.
    "internal-tls-secret": {
        "tls": {"internal": {"enabled": True, "secretName": "stormserve-internal-tls"}},
        "envoy": {"enabled": True},
    },
    # A worker that spans pods: a LeaderWorkerSet of 2 groups of 2 pods, 8 NPUs each.
    "multi-node": {
        "worker": {"accelerator": "npu", "nodes": 2, "tensorParallelSize": 8, "replicas": 2},
        "model": {"source": "pvc", "pvc": {"claimName": "deepseek-r1"}, "path": "DeepSeek-R1-W8A8",
                  "name": "DeepSeek-R1"},
        "metrics": {"enabled": True},
    },
    # Prefill/decode disaggregation (tests/deploy/test_chart_disaggregation.py): a pool per role,
    # the prefill pool with resources, settings and nodes of its own; and per serving group.
    "disaggregated": {
        "worker": {"env": {"LOG_LEVEL": "DEBUG"}, "podAnnotations": {"team": "llm"},
                   "disaggregation": {"enabled": True,
                                      "prefill": {"replicas": 2, "env": {"MAX_BATCH_SIZE": "8"},
                                                  "resources": {"requests": {"cpu": "8", "memory": "12Gi"},
                                                                "limits": {"memory": "16Gi"}},
                                                  "nodeSelector": {"pool": "prefill"},
                                                  "podAnnotations": {"pool": "prefill"}},
                                      "decode": {"replicas": 3}}},
        "config": {"KV_TRANSFER_TIMEOUT_S": "90"},
        "metrics": {"enabled": True},
    },
    "disaggregated-two-groups": {"scheduler": {"groups": 2},
                                 "worker": {"disaggregation": {"enabled": True, "decode": {"replicas": 2}}}},
    "disaggregated-static": {"scheduler": {"workerDiscovery": "static"},
                             "worker": {"disaggregation": {"enabled": True, "prefill": {"replicas": 2}}}},
    "internal-tls-cert-manager": {
        "tls": {"internal": {"enabled": True, "serverName": "llm.internal.example",
                             "certManager": {"issuerRef": {"name": "stormserve-ca", "kind": "ClusterIssuer"}}}},
        "metrics": {"enabled": True, "podMonitor": {"enabled": True}},
    },
}

# Each service's config, by the module a container runs (`python -m services.<module>`).
CONFIGS = {"http_edge": EdgeConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
           "worker": WorkerConfig, "worker.follower": WorkerConfig, "envoy": EnvoyConfig}


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
