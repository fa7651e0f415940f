"""Starts the real chain (four processes, the real bundled model) on free ports."""
from __future__ import annotations

import contextlib
import time

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.supervisor import Chain, free_port
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@contextlib.contextmanager
def running_chain(log_dir, num_workers: int = 1, env: dict[str, str] | None = None, envoy=None,
                  health_ports: dict[str, int] | None = None, worker_roles: list[str] | None = None):
    """The chain on free ports, yielded as (chain, scheduler stub) once /health
    answers and every worker is ready; stopped afterwards.

    Workers get a 1 GiB KV pool unless `env` says otherwise: the automatic
    budget (several GiB, touched at start) is more than any test needs, and
    several chains run at once. `envoy` (an EnvoyConfig) puts Envoy in front;
    `health_ports` gives processes (by name) a plaintext health-only port;
    `worker_roles` each worker's role (prefill, decode or both)."""
    env = {"STORMSERVE_KV_CACHE_MIB": "1024", **(env or {})}
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  worker_ports=[free_port() for _ in range(num_workers)], env=env, log_dir=log_dir,
                  envoy=envoy, health_ports=dict(health_ports or {}), worker_roles=list(worker_roles or []))
    chain.start()
    channel = scheduler_channel(chain)
    try:
        chain.wait_ready(timeout_s=600)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        deadline = time.monotonic() + 600
        # /health is up with one worker; some tests need every one of them.
        while load_reader(stub)().num_workers_ready < num_workers:
            assert time.monotonic() < deadline, "workers did not all become ready"
            time.sleep(0.5)
        yield chain, stub
    finally:
        chain.stop()
        channel.close()
        print(f"chain logs: {log_dir}")


def scheduler_channel(chain) -> grpc.Channel:
    """A channel to the chain's scheduler; over mutual TLS when the chain's env turns it on."""
    address, tls = f"127.0.0.1:{chain.scheduler_port}", chain.internal_tls
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def load_reader(stub):
    """Reads the scheduler's occupancy straight from its gRPC API."""
    return lambda: stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)


def wait_until_idle(load, timeout_s: float = 20.0):
    """Polls `load` (a load_reader) until the scheduler runs and queues nothing, at
    most `timeout_s`; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while (now := load()).num_running + now.num_waiting and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


def scrape(url: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """One /metrics page: each family's type, and each sample's value by (name, labels)."""
    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200, url
    types, samples = {}, {}
    for family in text_string_to_metric_families(reply.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def total(samples, name: str, **labels) -> float:
    """Summed over every series of `name` that has `labels` (over engines, as a dashboard would)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def aborted_requests(chain) -> float:
    """Sequences the scheduler has ended because their caller went away (or cancelled):
    what proves a disconnect reached it, where a sequence that ran to its end would not."""
    samples = scrape(chain.metrics_urls["scheduler"])[1]
    return total(samples, "vllm:request_success_total", finished_reason="abort")


@pytest.fixture(scope="session")
def chain_and_stub(tmp_path_factory):
    """float32: tests assert exact greedy text, and in bfloat16 a near-tie between the
    top two logits can flip with batch composition or a prefix-cache hit (a different
    matmul blocking). The two-worker chain of test_engine_e2e runs the bf16 default."""
    with running_chain(tmp_path_factory.mktemp("chain-logs"), env={"STORMSERVE_DTYPE": "float32"}) as running:
        yield running


@pytest.fixture(scope="session")
def tiny_kv_chain_and_stub(tmp_path_factory):
    """float32 for exact text; 6 MiB = 8 KV blocks of 16 tokens (SmolLM2-135M in
    float32 needs ~0.7 MiB per block): one request fits, four at once do not."""
    env = {"STORMSERVE_KV_CACHE_MIB": "6", "STORMSERVE_DTYPE": "float32"}
    with running_chain(tmp_path_factory.mktemp("tiny-kv"), env=env) as running:
        yield running


@pytest.fixture(scope="session")
def chain(chain_and_stub):
    return chain_and_stub[0]


@pytest.fixture(scope="session")
def base_url(chain):
    return chain.url


@pytest.fixture(scope="session")
def openai_client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def scheduler_load(chain_and_stub):
    return load_reader(chain_and_stub[1])
