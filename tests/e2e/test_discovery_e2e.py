"""Workers found through EndpointSlices, end to end: three real worker
processes (as pods: each on its own loopback address, all on one port) behind
a real scheduler, tokenizer and edge whose scheduler watches the fake
Kubernetes API server (tests/fake_kube.py).

The tests run in file order on one running system and each leaves it as the
next expects: a worker added at run time gets traffic; one marked not ready
drains; one removed mid-stream fails only its own request; a dropped watch, a
410 ERROR event on the open watch and an HTTP 410 on a new one each lead to a
re-list that finds the truth."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from services.common.errors import WORKER_LOST
from services.common.supervisor import Chain, free_port
from stormserve.scheduler.v1 import scheduler_pb2_grpc
from tests.e2e.conftest import MODEL, load_reader
from tests.fake_kube import FakeKube, endpoint_slice, slice_endpoint

NS, SERVICE = "serving", "stormserve-worker"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
LONG_S = 6.0


@dataclass
class Pod:
    host: str
    uid: str
    ready: bool = True
    terminating: bool = False


@dataclass
class Cluster:
    kube: FakeKube
    chain: Chain
    port: int
    load: Callable[[], object] | None
    # Tokens of a stream that must outlive a change of the worker set: about
    # LONG_S seconds of decoding at the speed measured at start.
    long: int = 0
    # The worker Service's slices as the test means them to be: slice name -> pods.
    slices: dict[str, list[Pod]] = field(default_factory=dict)

    def address(self, host: str) -> str:
        return f"{host}:{self.port}"

    def slice_objects(self) -> list[dict]:
        return [endpoint_slice(name, SERVICE, [slice_endpoint(p.host, uid=p.uid, ready=p.ready,
                                                              terminating=p.terminating, namespace=NS)
                                               for p in pods], self.port, namespace=NS)
                for name, pods in self.slices.items()]

    def publish(self, name: str) -> None:
        """Write slice `name` as `slices` says (a watch event)."""
        obj = next(o for o in self.slice_objects() if o["metadata"]["name"] == name)
        self.kube.put_slice(NS, obj)

    def workers(self) -> dict[str, object]:
        """GetLoad's workers by address."""
        return {w.address: w for w in self.load().workers}

    def wait(self, condition, what: str, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while not (result := condition()):
            assert time.monotonic() < deadline, f"{what}: {self.load()}"
            time.sleep(0.1)
        return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("discovery")
    kube = FakeKube(bookmark_interval_s=1.0).start()
    port = free_port()
    env = {
        # One thread per worker: three of them share the machine.
        "STORMSERVE_DTYPE": "float32", "STORMSERVE_KV_CACHE_MIB": "1024", "STORMSERVE_NUM_THREADS": "1",
        "STORMSERVE_WORKER_DISCOVERY": "endpointslices", "STORMSERVE_WORKER_SERVICE": SERVICE,
        "STORMSERVE_WORKER_NAMESPACE": NS, "STORMSERVE_WORKER_PORT": "grpc",
        "STORMSERVE_KUBE_API_URL": kube.url,
    }
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  worker_ports=[], env=env, log_dir=log_dir)
    channel = None
    try:
        # The worker pods start first; the scheduler knows them only from the slices.
        for i, host in enumerate(HOSTS):
            chain._spawn(f"worker{i}", "services.worker", "--host", host, "--port", str(port))
        running = Cluster(kube, chain, port, load=None)
        running.slices = {f"{SERVICE}-a": [Pod(HOSTS[0], "pod-0"), Pod(HOSTS[1], "pod-1")]}
        running.publish(f"{SERVICE}-a")
        for host in HOSTS:  # loaded before the rest starts: less contention for the CPU
            wait_serving(f"{host}:{port}", chain)
        chain.start()
        chain.wait_ready(timeout_s=600)
        channel = grpc.insecure_channel(f"127.0.0.1:{chain.scheduler_port}")
        running.load = load_reader(scheduler_pb2_grpc.SchedulerServiceStub(channel))
        running.wait(lambda: running.load().num_workers_ready == 2, "both listed workers ready", 600)
        started = time.monotonic()
        ask(chain.url, "Warm up.", max_tokens=16, ignore_eos=True)
        rate = 16 / (time.monotonic() - started)
        running.long = max(24, min(400, int(rate * LONG_S)))
        print(f"{rate:.1f} tokens/s: long streams of {running.long} tokens")
        yield running
    finally:
        chain.stop()
        kube.stop()
        if channel is not None:
            channel.close()
        print(f"discovery logs: {log_dir}")


def wait_serving(address: str, chain: Chain, timeout_s: float = 600.0) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            for name, proc in chain.procs.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode}{chain._log_hint(name)}"
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"worker {address} did not start"
            time.sleep(0.5)


@dataclass
class StreamResult:
    frames: list[dict] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    @property
    def error(self) -> dict | None:
        return next((f for f in self.frames if "error" in f), None)

    @property
    def completion_tokens(self) -> int:
        return next((f["usage"]["completion_tokens"] for f in self.frames if f.get("usage")), 0)


def stream_chat(url: str, question: str, max_tokens: int, result: StreamResult) -> StreamResult:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                result.frames.append(json.loads(line[len("data: "):]))
                if any(c.get("delta", {}).get("content") for c in result.frames[-1].get("choices", [])):
                    result.started.set()
    result.started.set()
    return result


def ask(url: str, question: str, max_tokens: int = 4, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, **extra}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def idle(cluster: Cluster) -> bool:
    load = cluster.load()
    return load.num_running == 0 and load.num_waiting == 0


def test_a_worker_added_at_run_time_gets_traffic(cluster):
    cluster.slices[f"{SERVICE}-b"] = [Pod(HOSTS[2], "pod-2")]
    cluster.publish(f"{SERVICE}-b")
    cluster.wait(lambda: cluster.load().num_workers_ready == 3, "the added worker joins", 300)
    new = cluster.address(HOSTS[2])
    assert cluster.workers()[new].num_sequences == 0
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: ask(cluster.chain.url, f"Count to {i + 3}."), range(6)))
    assert all(r["usage"]["completion_tokens"] > 0 for r in replies)
    assert cluster.workers()[new].num_sequences > 0, cluster.load()


def test_a_worker_marked_not_ready_drains(cluster):
    cluster.wait(lambda: idle(cluster), "idle")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_chat, cluster.chain.url, "Tell a long story.", cluster.long, StreamResult())
        busy = cluster.wait(lambda: next((a for a, w in cluster.workers().items() if w.num_running == 1), None),
                            "the long stream runs")
        pod = next(p for pods in cluster.slices.values() for p in pods if cluster.address(p.host) == busy)
        name = next(n for n, pods in cluster.slices.items() if pod in pods)
        pod.ready = False
        cluster.publish(name)
        draining = cluster.wait(lambda: cluster.workers()[busy].draining and cluster.workers()[busy],
                                "the worker drains")
        assert draining.num_running == 1 and not draining.is_ready  # its stream still runs there; nothing new
        assert cluster.load().num_workers_ready == 2
        placed = draining.num_sequences
        with ThreadPoolExecutor(4) as more:
            replies = list(more.map(lambda i: ask(cluster.chain.url, f"Name a colour, {i}."), range(4)))
        assert all(r["usage"]["completion_tokens"] > 0 for r in replies)
        assert cluster.workers()[busy].num_sequences == placed  # new requests went elsewhere
        result = running.result(timeout=300)
    assert result.error is None and result.completion_tokens == cluster.long, result.frames[-3:]
    assert result.frames[-2]["choices"][0]["finish_reason"] == "length"
    # Ready again: it takes new sequences again.
    pod.ready = True
    cluster.publish(name)
    cluster.wait(lambda: not cluster.workers()[busy].draining and cluster.load().num_workers_ready == 3,
                 "the worker is back")


def test_a_worker_removed_mid_stream_fails_only_its_own_request(cluster):
    cluster.wait(lambda: idle(cluster), "idle")
    with ThreadPoolExecutor(2) as pool:
        results = [StreamResult(), StreamResult()]
        futures = [pool.submit(stream_chat, cluster.chain.url, f"Tell a long story, number {i}.", cluster.long, r)
                   for i, r in enumerate(results)]
        cluster.wait(lambda: sum(w.num_running == 1 for w in cluster.workers().values()) == 2,
                     "the two streams run on two workers")
        for r in results:
            assert r.started.wait(120), "no token streamed"
        victim = next(a for a, w in cluster.workers().items() if w.num_running == 1)
        name, pods = next((n, pods) for n, pods in cluster.slices.items()
                          if any(cluster.address(p.host) == victim for p in pods))
        pods[:] = [p for p in pods if cluster.address(p.host) != victim]
        cluster.publish(name)  # the endpoint is gone from its slice
        outcomes = [f.result(timeout=300) for f in futures]
    failed = [r for r in outcomes if r.error is not None]
    assert len(failed) == 1, [r.frames[-2:] for r in outcomes]
    message = failed[0].error["message"]
    assert message == WORKER_LOST and victim not in json.dumps(failed[0].error), message
    survivor = next(r for r in outcomes if r.error is None)
    assert survivor.completion_tokens == cluster.long
    assert victim not in cluster.workers() and cluster.load().num_workers_ready == 2
    # Still serving on the others.
    assert ask(cluster.chain.url, "What is 2 plus 2?")["usage"]["completion_tokens"] > 0


def test_a_dropped_watch_and_a_410_relist_and_find_the_truth(cluster):
    kube = cluster.kube
    present = {p.host for pods in cluster.slices.values() for p in pods}
    gone_host = next(h for h in HOSTS if h not in present)  # the one removed above
    # A new pod on the freed address (a new UID), with no watch event: not seen...
    cluster.slices[f"{SERVICE}-c"] = [Pod(gone_host, "pod-new")]
    kube.set_slices_quietly(NS, cluster.slice_objects())
    lists = kube.num_lists
    time.sleep(1.5)
    assert cluster.address(gone_host) not in cluster.workers()
    # ...until the watch drops and the scheduler lists again.
    kube.drop_watches()
    cluster.wait(lambda: cluster.load().num_workers_ready == 3, "the re-list after a dropped watch", 120)
    assert kube.num_lists > lists

    # Quietly one worker turns not ready; the open watch then ends with an ERROR event of code 410.
    drained = cluster.slices[f"{SERVICE}-c"][0]
    drained.ready = False
    kube.set_slices_quietly(NS, cluster.slice_objects())
    time.sleep(1.0)
    assert not cluster.workers()[cluster.address(gone_host)].draining
    lists, gone = kube.num_lists, kube.num_gone
    kube.compact()
    cluster.wait(lambda: cluster.workers()[cluster.address(gone_host)].draining, "the re-list after a 410 event")
    assert kube.num_lists > lists and kube.num_gone == gone + 1 and cluster.load().num_workers_ready == 2
    assert ask(cluster.chain.url, "Say hello.")["usage"]["completion_tokens"] > 0

    # The worker turns ready again between a list and its watch, and the history
    # is compacted there too: that watch is answered HTTP 410, and only the list
    # after it shows the worker ready.
    def ready_again_and_compact():
        drained.ready = True
        kube.set_slices_quietly(NS, cluster.slice_objects())
        kube.compact()

    cluster.wait(lambda: "watch=1" in kube.requests[-1][1], "the watch open again")
    kube.gone_as_http = True
    lists, replies = kube.num_lists, len(kube.requests)
    kube.before_next_watch(ready_again_and_compact)
    kube.drop_watches()
    cluster.wait(lambda: cluster.load().num_workers_ready == 3, "the re-list after an HTTP 410", 120)
    assert kube.num_lists >= lists + 2  # the list after the drop, then the one after the 410
    assert [code for _, path, code in kube.requests[replies:] if "watch=1" in path][0] == 410, kube.requests[replies:]
    assert not cluster.workers()[cluster.address(gone_host)].draining
    assert ask(cluster.chain.url, "Say hello.")["usage"]["completion_tokens"] > 0
