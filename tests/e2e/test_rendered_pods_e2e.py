"""The pods the Helm chart renders, run as processes on this machine: what the
chart says is what the code runs.

The chart (deploy/k8s) is rendered with its default values, two workers and
one API key (so the Secret is used). From every rendered Deployment and
StatefulSet the test takes each container's command, args, env (envFrom and
valueFrom resolved against the rendered ConfigMap and Secret, fieldRef
against the pod) and ports, on top of the image's own environment (the final
stage of deploy/Dockerfile, its WORKDIR being this checkout). Each pod gets its
own loopback address; a Service's DNS name in any env value or argument becomes
the address of a pod behind it (its selector against the pod labels) and a
Service port becomes the targetPort it maps to; a bind host of 0.0.0.0 or ::
becomes the pod's address; an emptyDir's mount path becomes a directory here
(one per path: see Cluster.prepare).
A small fake Kubernetes API server (tests/fake_kube.py) serves the EndpointSlices
of every rendered Service built as the EndpointSlice controller builds them:
an endpoint per selected pod, ready once that pod's readinessProbe passes.

The processes are started as Kubernetes would start them, all at once; the
test then plays kubelet: it runs each container's own startup, readiness and
liveness probes (gRPC health Check with the probe's service name, HTTP GET, TCP
connect) until every pod is ready, and sends chat requests with the `openai`
client to the edge Service's port. So a wrong env name, port, Service name or
probe service name in the chart fails here.

The harness is tests/e2e/rendered_cluster.py. What this machine adds to a
pod's environment is its MACHINE_ENV and nothing else; the harness refuses to
let it replace anything the chart sets. A Deployment left to its
HorizontalPodAutoscaler runs one pod. The pods' cache starts with links to
what this machine has already converted and built (seed_cache). The root
filesystem is not made read-only (tests/deploy/test_chart_pods.py checks that
the code writes only where the chart mounts emptyDirs)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest

from stormserve.scheduler.v1 import scheduler_pb2_grpc
from tests.chart import NAMESPACE, render
from tests.e2e.conftest import load_reader
from tests.e2e.rendered_cluster import (
    START_TIMEOUT_S,
    Cluster,
    assign_addresses,
    http_probe_status,
    pods_of,
    probe,
    seed_cache,
)
from tests.fake_kube import SERVICE_NAME_LABEL, FakeKube

API_KEY = "rendered-pods-key"
# The chart's defaults, and only these changes: two workers (one StatefulSet,
# found through its Service's EndpointSlices) and one API key, so that the
# edge and the tokenizer read the key file of the Secret the chart renders.
VALUES = {"worker": {"replicas": 2}, "apiKeys": {"keys": [API_KEY]}}

# ---- the test ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    objects = render(VALUES)
    logs = tmp_path_factory.mktemp("rendered-pods-logs")
    scratch = tmp_path_factory.mktemp("rendered-pods")
    kube = FakeKube(bookmark_interval_s=1.0).start()
    running = Cluster(objects, pods_of(objects), kube)
    try:
        assign_addresses(running.pods)
        for pod in running.pods:
            running.prepare(pod, scratch)
        for cache in {pod.env["STORMSERVE_CACHE_DIR"] for pod in running.pods}:
            seed_cache(Path(cache))
        # Pods get their addresses before they run: every Service's slice lists
        # them, not ready.
        running.publish()
        started = time.monotonic()
        for pod in running.pods:
            running.start(pod, logs)
        running.wait_ready(START_TIMEOUT_S)
        print(f"{len(running.pods)} pods ready in {time.monotonic() - started:.1f} s")
        yield running
    finally:
        running.stop()
        kube.stop()
        print(f"rendered pods' logs: {logs}")


@pytest.fixture(scope="module")
def scheduler_load(cluster):
    (service,) = [s for s in cluster.services if cluster.behind(s) == cluster.by_module("scheduler")]
    address = cluster.resolve(f"{service['metadata']['name']}.{NAMESPACE}.svc:{service['spec']['ports'][0]['port']}")
    with grpc.insecure_channel(address) as channel:
        yield load_reader(scheduler_pb2_grpc.SchedulerServiceStub(channel))


@pytest.fixture(scope="module")
def edge_url(cluster):
    """The edge Service's port, as a client in the cluster calls it."""
    (service,) = [s for s in cluster.services if cluster.behind(s) == cluster.by_module("http_edge")]
    (port,) = service["spec"]["ports"]
    return "http://" + cluster.resolve(f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port['port']}")


@pytest.fixture(scope="module")
def model(cluster):
    """The model the tokenizer serves, by the name the chart gives it."""
    (tokenizer, *_) = cluster.by_module("tokenizer")
    return tokenizer.env["STORMSERVE_MODEL_NAME"]


def openai_client(edge_url: str, api_key: str = API_KEY):
    from openai import OpenAI

    return OpenAI(base_url=edge_url + "/v1", api_key=api_key, timeout=120, max_retries=0)


def test_the_rendered_release_runs_every_workload(cluster):
    modules = sorted(p.module for p in cluster.pods)
    assert modules == ["http_edge", "scheduler", "tokenizer", "worker", "worker"]
    (scheduler,) = cluster.by_module("scheduler")
    # In a cluster the scheduler's namespace is its service account's: the token must be mounted.
    assert scheduler.spec["automountServiceAccountToken"] is True and scheduler.spec["serviceAccountName"]
    for pod in cluster.pods:
        assert pod.proc.poll() is None, pod.name


def test_every_probe_answers_on_the_port_it_names(cluster):
    for pod in cluster.pods:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = pod.container.get(kind)
            if spec is None:
                continue
            where = f"{pod.name} {kind} {spec}"
            assert probe(pod, spec), where
            if "httpGet" in spec:
                assert http_probe_status(pod, spec["httpGet"]) == 200, where
        # Every port the container declares is open.
        for port in pod.container.get("ports", []):
            assert probe(pod, {"tcpSocket": {"port": port["containerPort"]}}), f"{pod.name} {port}"


def test_the_scheduler_finds_every_worker_pod_through_the_endpointslices(cluster, scheduler_load):
    workers = cluster.by_module("worker")
    (service,) = [s for s in cluster.services if cluster.behind(s) == workers]
    expected = {f"{p.ip}:{p.container_port(service['spec']['ports'][0]['targetPort'])}" for p in workers}
    deadline = time.monotonic() + 60
    while (load := scheduler_load()).num_workers_ready < len(workers):
        assert time.monotonic() < deadline, load
        time.sleep(0.5)
    assert {w.address for w in load.workers} == expected and all(w.is_ready for w in load.workers), load
    # It asked for the worker Service's slices, in the release's namespace, by the label.
    calls = [urlsplit(path) for _, path, _ in cluster.kube.requests]
    assert calls and all(c.path == f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
                         and parse_qs(c.query)["labelSelector"] == [f"{SERVICE_NAME_LABEL}={service['metadata']['name']}"]
                         for c in calls), calls
    assert cluster.kube.num_lists >= 1 and cluster.kube.num_watches >= 1


def test_chat_through_the_edge_service(edge_url, model):
    client = openai_client(edge_url)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=8, temperature=0)
    assert reply.model == model and reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens > 0


def test_the_edge_takes_its_api_key_from_the_secret(edge_url, model):
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai_client(edge_url, api_key="not-the-key").chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi."}], max_tokens=2)


def test_both_workers_get_requests(cluster, edge_url, model, scheduler_load):
    client = openai_client(edge_url)

    def ask(i: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Name a colour, number {i}."}],
            max_tokens=4, temperature=0)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, range(6)))
    assert all(r.usage.completion_tokens > 0 for r in replies)
    placed = {w.address: w.num_sequences for w in scheduler_load().workers}
    assert len(placed) == 2 and all(n > 0 for n in placed.values()), placed
