"""Starts the real chain (four processes, the real bundled model) on free ports."""
from __future__ import annotations

import grpc
import pytest

from services.common.supervisor import Chain, free_port
from stormserve.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def chain(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chain-logs")
    chain = Chain(edge_port=free_port(), tokenizer_port=free_port(), scheduler_port=free_port(),
                  worker_ports=[free_port()], log_dir=log_dir)
    chain.start()
    try:
        chain.wait_ready(timeout_s=600)
        yield chain
    finally:
        chain.stop()
        print(f"chain logs: {log_dir}")


@pytest.fixture(scope="session")
def base_url(chain):
    return chain.url


@pytest.fixture(scope="session")
def openai_client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def scheduler_load(chain):
    """Reads the scheduler's occupancy straight from its gRPC API."""
    channel = grpc.insecure_channel(f"127.0.0.1:{chain.scheduler_port}")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    yield lambda: stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5)
    channel.close()
