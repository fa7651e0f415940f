"""The real chain with internal mutual TLS on (STORMSERVE_INTERNAL_TLS_* pointing
at a CA made here), Envoy in front: a chat completion crosses every hop (edge ->
tokenizer -> scheduler -> worker, and Envoy -> edge / tokenizer) over TLS, a
stranger (plaintext, no certificate, a certificate from another CA) is refused
on every internal port (the worker's step channel too), and /health, /metrics and the plaintext health ports
still answer without a certificate. One chain start for all of it."""
from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from stormserve.worker.v1 import worker_pb2, worker_pb2_grpc

from services.common.frames import read_frame, write_frame
from services.common.supervisor import free_port
from services.common.tls import InternalTls
from services.envoy.config import EnvoyConfig
from tests.e2e.conftest import MODEL, running_chain
from tests.tls import TestCA

QUESTION = [{"role": "user", "content": "Say hello."}]
BODY = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, stranger_ca = TestCA(directory / "ours"), TestCA(directory / "theirs", name="stranger CA")
    return ca, ca.issue_internal("services"), stranger_ca.issue_internal("stranger")


@pytest.fixture(scope="module")
def tls_chain(pki, tmp_path_factory):
    ca, services, _ = pki
    settings = {"internal_tls_cert_file": str(services.cert), "internal_tls_key_file": str(services.key),
                "internal_tls_ca_file": str(ca.cert)}
    env = {f"STORMSERVE_{name.upper()}": value for name, value in settings.items()}
    # The gRPC services' plaintext health ports, as the chart gives them for kubelet probes.
    health_ports = {name: free_port() for name in ("worker0", "scheduler", "tokenizer")}
    envoy = EnvoyConfig(envoy_port=free_port(), envoy_admin_port=free_port(), **settings)
    with running_chain(tmp_path_factory.mktemp("internal-tls"), env=env, envoy=envoy,
                       health_ports=health_ports) as (chain, _stub):
        yield chain, health_ports


@pytest.fixture(scope="module")
def chain(tls_chain):
    return tls_chain[0]


def grpc_ports(chain) -> dict[str, int]:
    return {"tokenizer": chain.tokenizer_port, "scheduler": chain.scheduler_port, "worker": chain.worker_ports[0]}


def health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return reply.status


def tls_channel(address: str, tls: InternalTls) -> grpc.Channel:
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def test_a_chat_completion_crosses_every_hop_over_tls(chain):
    assert chain.url.startswith("https://")
    with httpx.Client(verify=chain.internal_tls.client_ssl_context(), timeout=120) as client:
        reply = client.post(chain.url + "/v1/chat/completions", json=BODY)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


def test_strangers_are_refused_on_every_grpc_port(chain, pki):
    ca, _, stranger = pki
    ours = chain.internal_tls
    theirs = InternalTls(str(stranger.cert), str(stranger.key), str(ca.cert))
    no_certificate = grpc.ssl_channel_credentials(root_certificates=ca.cert.read_bytes())
    for name, port in grpc_ports(chain).items():
        address = f"127.0.0.1:{port}"
        with tls_channel(address, ours) as channel:  # the port is right, and serves its peers
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING, name
        strangers = {"plaintext": lambda: grpc.insecure_channel(address),
                     "no certificate": lambda: grpc.secure_channel(address, no_certificate,
                                                                   options=ours.channel_options()),
                     "another CA's certificate": lambda: tls_channel(address, theirs)}
        for who, make in strangers.items():
            with make() as channel, pytest.raises(grpc.RpcError) as refused:
                health(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (name, who)


def test_the_workers_step_channel_takes_steps_from_its_peers_alone(chain, pki):
    ca, _, stranger = pki
    ours = chain.internal_tls
    with tls_channel(f"127.0.0.1:{chain.worker_ports[0]}", ours) as channel:
        port = worker_pb2_grpc.WorkerServiceStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10).step_port
    assert port > 0
    no_certificate = ssl.create_default_context(cafile=str(ca.cert))
    theirs = InternalTls(str(stranger.cert), str(stranger.key), str(ca.cert)).peer_ssl_context()

    async def step(context: ssl.SSLContext | None) -> worker_pb2.StepStreamResponse | None:
        """An empty step's answer (None: the connection ended without one)."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname=ours.server_name if context else None)
        try:
            write_frame(writer, worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(step_id=7)))
            await writer.drain()
            answer = await asyncio.wait_for(read_frame(reader), 30)
            return None if answer is None else worker_pb2.StepStreamResponse.FromString(answer)
        finally:
            writer.close()

    assert asyncio.run(step(ours.peer_ssl_context())).step.step_id == 7
    for who, context in {"plaintext": None, "no certificate": no_certificate, "another CA's certificate": theirs}.items():
        try:
            answer = asyncio.run(step(context))
        except OSError:  # the handshake or the read, as TLS 1.3 reports a refused client certificate
            continue
        assert answer is None, who


def test_the_plaintext_health_ports_answer_health_alone(tls_chain):
    _, health_ports = tls_chain
    for name, port in health_ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.RpcError) as refused:
                chat_pb2_grpc.ChatServiceStub(channel).ListModels(chat_pb2.ListModelsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, name


def test_the_edge_refuses_strangers_on_its_api_but_not_on_health_and_metrics(chain, pki):
    ca, _, stranger = pki
    anonymous = ssl.create_default_context(cafile=str(ca.cert))  # trusts the edge, has no certificate
    anonymous.check_hostname = False
    with httpx.Client(verify=anonymous, timeout=30) as client:
        assert client.get(chain.url + "/health").status_code == 200
        assert client.get(chain.url + "/metrics").status_code == 200
        for reply in (client.post(chain.url + "/v1/chat/completions", json=BODY), client.get(chain.url + "/v1/models")):
            assert reply.status_code == 403 and "client certificate" in reply.json()["message"]
    with_stranger = ssl.create_default_context(cafile=str(ca.cert))
    with_stranger.check_hostname = False
    with_stranger.load_cert_chain(str(stranger.cert), str(stranger.key))
    with httpx.Client(verify=with_stranger, timeout=30) as client, pytest.raises(httpx.TransportError):
        client.get(chain.url + "/health")
    with pytest.raises(httpx.TransportError):
        httpx.get(chain.url.replace("https://", "http://") + "/v1/models", timeout=30)


def test_envoy_reaches_the_edge_and_the_tokenizer_over_tls(chain):
    assert chain.envoy_url.startswith("http://")  # its own listener is plaintext here; upstream is TLS
    reply = httpx.post(chain.envoy_url + "/v1/chat/completions", json=BODY, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    with grpc.insecure_channel(chain.envoy_url.removeprefix("http://")) as channel:
        models = chat_pb2_grpc.ChatServiceStub(channel).ListModels(chat_pb2.ListModelsRequest(), timeout=30)
    assert MODEL in [m.id for m in models.models]
