"""A rendered release's pods run as processes on this machine, as kubelet would
run them: each container's command, args and environment (the image's, its
ConfigMaps and Secret, fieldRefs), a loopback address per pod, Services
resolved to the pods behind them, EndpointSlices published on a fake API
server, and the containers' own probes played until every pod is ready.
tests/e2e/test_rendered_pods_e2e.py says what it checks with it."""
from __future__ import annotations

import base64
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.supervisor import SUPERVISOR_PID_ENV
from tests.chart import NAMESPACE, ROOT, named, of_kind, selects, workloads
from tests.fake_kube import SERVICE_NAME_LABEL, FakeKube, endpoint_slice, slice_endpoint

# Set by this machine, by the container's module (`python -m services.<module>`):
MACHINE_ENV = {
    # Two workers share two loaded cores: one thread each, and a small KV pool
    # instead of the automatic budget (a share of the node's memory, touched at start).
    "worker": {"STORMSERVE_NUM_THREADS": "1", "STORMSERVE_KV_CACHE_MIB": "256"},
    # In a pod the namespace comes from the mounted service-account token
    # (automountServiceAccountToken, checked below) and the API server from
    # KUBERNETES_SERVICE_HOST/PORT; here the namespace is given and the API
    # server is the fake one (its URL is added at start).
    "scheduler": {"STORMSERVE_WORKER_NAMESPACE": NAMESPACE},
}
# Plumbing, not configuration: a pod process gets SIGTERM if the test process dies.
PLUMBING_ENV = {SUPERVISOR_PID_ENV: str(os.getpid())}
# What the base image (python:3.11-slim) sets that the services may use.
BASE_IMAGE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
NODE_NAME = "this-machine"
START_TIMEOUT_S = 240.0
STOP_GRACE_S = 10.0


# ---- the image ----------------------------------------------------------------


def image_env() -> tuple[dict[str, str], str]:
    """The environment the image gives every container, in the container's
    terms, and the image's WORKDIR: the ENV instructions of the Dockerfile's
    final stage over the base image's (BASE_IMAGE_ENV)."""
    text = re.sub(r"\\\n", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    stage = text.split("\nFROM ")[-1]
    workdir = ""
    env = dict(BASE_IMAGE_ENV)
    for line in stage.splitlines():
        instruction, _, args = line.strip().partition(" ")
        if instruction == "WORKDIR":
            workdir = args.strip()
        elif instruction == "ENV":
            for item in shlex.split(args):
                name, _, value = item.partition("=")
                env[name] = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), value)
    assert workdir, "the image's final stage has no WORKDIR"
    return env, workdir


# ---- pods -------------------------------------------------------------------------


@dataclass
class Pod:
    name: str
    workload: dict
    container: dict
    ip: str = ""
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    dirs: dict[str, Path] = field(default_factory=dict)  # emptyDir mount path -> the directory here
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started: bool = False  # the startupProbe passed (or there is none)
    ready: bool = False  # the readinessProbe passed

    @property
    def spec(self) -> dict:
        return self.workload["spec"]["template"]["spec"]

    @property
    def module(self) -> str:
        command = self.container["command"]
        assert command[:2] == ["python", "-m"] and command[2].startswith("services."), command
        return command[2].removeprefix("services.")

    def container_port(self, port: int | str) -> int:
        """A port by number or by the name the container gives it."""
        ports = self.container.get("ports", [])
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        (number,) = [p["containerPort"] for p in ports if p.get("name") == port] or [None]
        assert number is not None, f"{self.name}: no container port named {port!r}"
        return number

    def alive(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"pod {self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


def pods_of(objects) -> list[Pod]:
    """The pods the workloads make: a StatefulSet's <name>-<i>, a Deployment's
    <name>-<hash>-<suffix>; a Deployment left to its HorizontalPodAutoscaler
    (no replicas) runs one pod here."""
    pods = []
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]  # one container per pod, no init containers: what the chart renders
        assert not spec.get("initContainers"), name
        for i in range(workload["spec"].get("replicas", 1)):
            if workload["kind"] == "StatefulSet":
                pod_name = f"{name}-{i}"
            else:
                pod_name = f"{name}-{random_suffix(10)}-{random_suffix(5)}"
            pods.append(Pod(pod_name, workload, container))
    return pods


def random_suffix(n: int) -> str:
    return "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=n))


def assign_addresses(pods: list[Pod]) -> None:
    """One loopback address per pod, 127.0.0.x, a block whose container ports are free."""
    for _ in range(50):
        first = random.randrange(10, 250 - len(pods))
        ips = [f"127.0.0.{first + i}" for i in range(len(pods))]
        if all(port_free(ip, p["containerPort"]) for ip, pod in zip(ips, pods)
               for p in pod.container.get("ports", [])):
            for ip, pod in zip(ips, pods):
                pod.ip = ip
            return
    pytest.fail("no block of loopback addresses with the chart's ports free")


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---- the cluster ----------------------------------------------------------------


@dataclass
class Cluster:
    objects: tuple[dict, ...]
    pods: list[Pod]
    kube: FakeKube
    slice_names: dict[str, str] = field(default_factory=dict)  # Service -> its EndpointSlice

    @property
    def services(self) -> list[dict]:
        return of_kind(self.objects, "Service")

    def behind(self, service: dict) -> list[Pod]:
        return [p for p in self.pods if selects(service, p.workload)]

    def by_module(self, module: str) -> list[Pod]:
        return [p for p in self.pods if p.module == module]

    # -- names and addresses

    def service_address(self, service: dict, port: int | None) -> str:
        """Where a connection to the Service (at `port`) lands: a pod behind it
        at the targetPort (a headless Service: at the port as given)."""
        pods = self.behind(service)
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        pod = pods[0]
        if port is None:
            return pod.ip
        if service["spec"].get("clusterIP") != "None":
            (target,) = [p.get("targetPort", p["port"]) for p in service["spec"]["ports"] if p["port"] == port] or [
                None]
            assert target is not None, f"{service['metadata']['name']}:{port} is no port of that Service"
            port = pod.container_port(target)
        return f"{pod.ip}:{port}"

    def resolve(self, text: str, pod: Pod | None = None) -> str:
        """`text` with every Service DNS name in it (`svc`, `svc.ns`,
        `svc.ns.svc`, `svc.ns.svc.cluster.local`, with an optional :port) made
        an address here, and (for `pod`) 0.0.0.0 and :: made the pod's address.
        A bare `svc` counts as a host name only with a port or after `//`:
        alone it names the Service object (the scheduler's worker_service)."""
        names = sorted((s["metadata"]["name"] for s in self.services), key=len, reverse=True)
        pattern = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, names)) + r")"
                             rf"(\.{re.escape(NAMESPACE)}(?:\.svc(?:\.cluster\.local)?)?)?"
                             r"(?::(\d+))?(?![\w.-])")

        def address(match: re.Match) -> str:
            if not (match[2] or match[3] or text[:match.start()].endswith("//")):
                return match[0]
            service = named(self.objects, "Service", match[1])
            return self.service_address(service, int(match[3]) if match[3] else None)

        text = pattern.sub(address, text)
        if pod is not None:
            text = re.sub(r"^(0\.0\.0\.0|::|\[::\])(?=$|:\d+$)", pod.ip, text)
        return text

    # -- what kubelet and the EndpointSlice controller do

    def pod_env(self, pod: Pod) -> dict[str, str]:
        """The container's environment as the kubelet builds it, before any
        mapping to this machine: the image's, the pod's hostname, the Service
        links unless the pod turns them off (enableServiceLinks), then envFrom, then env."""
        links = self.service_links() if pod.spec.get("enableServiceLinks", True) else {}
        env = image_env()[0] | {"HOSTNAME": pod.name} | links
        for source in pod.container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = self.config_map(source["configMapRef"]["name"])
            else:
                data = self.secret(source["secretRef"]["name"])
            env |= {prefix + k: v for k, v in data.items()}
        for item in pod.container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
                continue
            ref = item["valueFrom"]
            if "configMapKeyRef" in ref:
                key = ref["configMapKeyRef"]
                env[item["name"]] = self.config_map(key["name"])[key["key"]]
            elif "secretKeyRef" in ref:
                key = ref["secretKeyRef"]
                env[item["name"]] = self.secret(key["name"])[key["key"]]
            elif "fieldRef" in ref:
                env[item["name"]] = self.field(pod, ref["fieldRef"]["fieldPath"])
            else:
                pytest.fail(f"{pod.name}: {item['name']}: no way to resolve {ref} here")
        return env

    def service_links(self) -> dict[str, str]:
        """The docker-link variables kubelet sets for every Service with a
        cluster IP in the namespace (here the address of a pod behind it)."""
        env = {}
        for service in self.services:
            if service["spec"].get("clusterIP") == "None" or not self.behind(service):
                continue
            prefix = service["metadata"]["name"].upper().replace("-", "_")
            host = self.behind(service)[0].ip
            ports = service["spec"]["ports"]
            env |= {f"{prefix}_SERVICE_HOST": host, f"{prefix}_SERVICE_PORT": str(ports[0]["port"]),
                    f"{prefix}_PORT": f"{ports[0].get('protocol', 'TCP').lower()}://{host}:{ports[0]['port']}"}
            for port in ports:
                protocol = port.get("protocol", "TCP")
                if port.get("name"):
                    env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
                base = f"{prefix}_PORT_{port['port']}_{protocol}"
                env |= {base: f"{protocol.lower()}://{host}:{port['port']}", f"{base}_PROTO": protocol.lower(),
                        f"{base}_PORT": str(port["port"]), f"{base}_ADDR": host}
        return env

    def config_map(self, name: str) -> dict[str, str]:
        return named(self.objects, "ConfigMap", name).get("data", {})

    def secret(self, name: str) -> dict[str, str]:
        secret = named(self.objects, "Secret", name)
        data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
        return data | secret.get("stringData", {})

    def field(self, pod: Pod, path: str) -> str:
        fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "metadata.uid": pod.uid,
                  "status.podIP": pod.ip, "status.podIPs": pod.ip, "status.hostIP": "127.0.0.1",
                  "spec.nodeName": NODE_NAME, "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default")}
        assert path in fields, f"{pod.name}: fieldRef {path} is not known here"
        return fields[path]

    def prepare(self, pod: Pod, scratch: Path) -> None:
        """The env and argv the pod's process gets on this machine.

        An emptyDir mounted at a path is one directory here for every pod that
        mounts one there: without mount namespaces, the same path in two pods
        can only be the same directory, and the path matters (the scheduler
        admits a worker only if its model's path is the other workers', which
        in a cluster is the same path in the cache emptyDir of every pod). What
        the code writes there is keyed by its sources and written through locks
        or temporary names, as when `make run`'s processes share one cache."""
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for mount in pod.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            assert "emptyDir" in volume or "secret" in volume, \
                f"{pod.name}: volume {mount['name']} is no emptyDir or Secret: not run here"
            pod.dirs[mount["mountPath"]] = scratch / mount["mountPath"].strip("/").replace("/", "-")
            pod.dirs[mount["mountPath"]].mkdir(exist_ok=True)
            if "secret" in volume:  # the kubelet writes each of the Secret's keys as a file
                for key, value in self.secret(volume["secret"]["secretName"]).items():
                    (pod.dirs[mount["mountPath"]] / key).write_text(value)

        # Paths in the container, longest first: the emptyDir mounts, then the image's WORKDIR (this checkout).
        workdir = image_env()[1]
        places = sorted([*pod.dirs.items(), (workdir, ROOT)], key=lambda kv: len(kv[0]), reverse=True)

        def local(value: str) -> str:
            """An env value or argument as it means here: names resolved, and
            each path in it (a :-separated list too) moved to where it is here."""
            parts = self.resolve(value, pod).split(":")
            for i, part in enumerate(parts):
                path = next((p for p, _ in places if part == p or part.startswith(p + "/")), None)
                if path is not None:
                    parts[i] = str(dict(places)[path]) + part[len(path):]
            return ":".join(parts)

        env = {name: local(value) for name, value in self.pod_env(pod).items()}
        machine = MACHINE_ENV.get(pod.module, {})
        if pod.module == "scheduler":
            machine = {**machine, "STORMSERVE_KUBE_API_URL": self.kube.url}
        replaced = set(machine) & set(env)
        assert not replaced, f"{pod.name}: the chart sets {replaced}, which this machine would replace"
        pod.env = {**env, **machine, **PLUMBING_ENV}
        if "/tmp" in pod.dirs:
            pod.env["TMPDIR"] = str(pod.dirs["/tmp"])
        command = [expand(a, pod.env) for a in pod.container["command"] + pod.container.get("args", [])]
        executable = shutil.which(command[0], path=pod.env["PATH"])
        assert executable, f"{pod.name}: {command[0]} is not on the image's PATH"
        pod.argv = [executable, *(local(a) for a in command[1:])]

    def start(self, pod: Pod, logs: Path) -> None:
        pod.log = logs / f"{pod.name}.log"
        with open(pod.log, "wb") as out:
            pod.proc = subprocess.Popen(pod.argv, env=pod.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def publish(self) -> None:
        """Every Service's EndpointSlice as the EndpointSlice controller writes it:
        an endpoint per selected pod, ready as its readinessProbe last said."""
        for service in self.services:
            name = service["metadata"]["name"]
            pods = self.behind(service)
            endpoints = []
            for pod in pods:
                ep = slice_endpoint(pod.ip, uid=pod.uid, ready=pod.ready, pod_name=pod.name, namespace=NAMESPACE)
                ep["nodeName"] = NODE_NAME
                if pod.workload["kind"] == "StatefulSet" and pod.workload["spec"].get("serviceName") == name:
                    ep["hostname"] = pod.name
                endpoints.append(ep)
            slice_name = self.slice_names.setdefault(name, f"{name}-{random_suffix(5)}")
            obj = endpoint_slice(slice_name, name, endpoints, port=0, namespace=NAMESPACE)
            obj["metadata"]["labels"] = {**service["metadata"].get("labels", {}), SERVICE_NAME_LABEL: name,
                                         "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
            obj["ports"] = [{"name": p.get("name", ""), "protocol": p.get("protocol", "TCP"),
                             "port": pods[0].container_port(p.get("targetPort", p["port"])) if pods else p["port"],
                             **({"appProtocol": p["appProtocol"]} if "appProtocol" in p else {})}
                            for p in service["spec"]["ports"]]
            known = {s["metadata"]["name"]: s for s in self.kube.slices(NAMESPACE)}.get(slice_name)
            if known is None or (known["endpoints"], known["ports"]) != (obj["endpoints"], obj["ports"]):
                self.kube.put_slice(NAMESPACE, obj)

    def wait_ready(self, timeout_s: float) -> None:
        """Kubelet's part: each pod's startupProbe until it passes, then its
        readinessProbe; a pod that turns ready is published ready."""
        deadline = time.monotonic() + timeout_s
        while not all(p.ready for p in self.pods):
            for pod in self.pods:
                pod.alive()
                if not pod.started:
                    pod.started = "startupProbe" not in pod.container or probe(pod, pod.container["startupProbe"])
                if pod.started and not pod.ready and probe(pod, pod.container["readinessProbe"]):
                    pod.ready = True
                    print(f"{pod.name} ({pod.ip}) ready")
                    self.publish()
            if time.monotonic() > deadline:
                waiting = {p.name: "ready" if p.ready else "started" if p.started else "starting" for p in self.pods}
                tails = "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in self.pods if not p.ready)
                pytest.fail(f"pods not ready within {timeout_s:.0f} s: {waiting}\n{tails}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to every pod, edge first; SIGKILL to any still there after the grace."""
        order = {"http_edge": 0, "tokenizer": 1, "scheduler": 2, "worker": 3}
        running = sorted((p for p in self.pods if p.proc is not None), key=lambda p: order.get(p.module, 9))
        for pod in running:
            if pod.proc.poll() is None:
                pod.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for pod in running:
            try:
                pod.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait()


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) references to variables defined before; $$ escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def probe(pod: Pod, spec: dict, timeout_s: float = 2.0) -> bool:
    """One run of a probe as kubelet runs it: gRPC health Check (SERVING),
    HTTP GET (200-399), TCP connect; exec probes are not run here.

    A health service that answers NOT_FOUND fails the test at once: the
    services register every name before they listen, so the probe names a
    service the process never serves and would fail until kubelet gives up."""
    if "grpc" in spec:
        address = f"{pod.ip}:{spec['grpc']['port']}"
        service = spec["grpc"].get("service", "")
        with grpc.insecure_channel(address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
            except grpc.RpcError as exc:
                status = exc.code()
        if status == grpc.StatusCode.NOT_FOUND:
            pytest.fail(f"{pod.name}: its health service at {address} knows no service {service!r}")
        return status == health_pb2.HealthCheckResponse.SERVING
    if "httpGet" in spec:
        return http_probe_status(pod, spec["httpGet"], timeout_s) in range(200, 400)
    if "tcpSocket" in spec:
        try:
            with socket.create_connection((pod.ip, pod.container_port(spec["tcpSocket"]["port"])), timeout_s):
                return True
        except OSError:
            return False
    pytest.fail(f"{pod.name}: probe {spec} is not run here")


def http_probe_status(pod: Pod, get: dict, timeout_s: float = 2.0) -> int:
    assert get.get("scheme", "HTTP") == "HTTP" and "host" not in get, get
    url = f"http://{pod.ip}:{pod.container_port(get['port'])}{get.get('path', '/')}"
    request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in get.get("httpHeaders", [])})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def seed_cache(directory: Path) -> None:
    """Links, in the pods' empty cache, to what this machine has already made in
    its own (the bundled model converted from GGUF, the CPU kernels built for
    this CPU), which the pods would otherwise make again (a ~20 s conversion).
    Names are keyed by their sources, so a link to a stale entry is never used."""
    mine = Path(os.environ.get("STORMSERVE_CACHE_DIR", Path.home() / ".cache" / "stormserve"))
    for kind in ("models", "kernels"):
        entries = [e for e in (mine / kind).glob("*") if not e.name.endswith((".lock", ".tmp"))] \
            if (mine / kind).is_dir() else []
        for entry in entries:
            (directory / kind).mkdir(exist_ok=True)
            (directory / kind / entry.name).symlink_to(entry)
