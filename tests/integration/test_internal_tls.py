"""Internal mutual TLS (services/common/tls.py) in-process, with CAs made here:
a GrpcService with TLS serves a client whose certificate its CA signed (through
`channel()`) and refuses every other one; its plaintext health port answers
health alone; the edge (uvicorn, the edge's protocol, on uvloop) reaches a TLS
ChatService and refuses API routes, but not /health or /metrics, to a client
without a certificate."""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import httpx
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc

from services.common.grpc_server import GrpcService, channel
from services.common.multiplex import multiplexed_method
from services.common.supervisor import free_port
from services.common.tls import InternalTls
from services.http_edge.config import EdgeConfig
from services.http_edge.server import build_server
from tests.integration.test_http_edge import serving
from tests.tls import Pair, TestCA


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class FakeChatService(chat_pb2_grpc.ChatServiceServicer):
    """One model; every chat answers "Hello" and stops."""

    async def ListModels(self, request, context) -> chat_pb2.ListModelsResponse:
        return chat_pb2.ListModelsResponse(models=[chat_pb2.Model(id="m", root="m", owned_by="stormserve",
                                                                  max_model_len=2048)])

    async def _chat(self, request) -> AsyncIterator[chat_pb2.ChatResponse]:
        yield chat_pb2.ChatResponse(chunk=chat_pb2.ChatChunk(
            id=request.request_id, model=request.model, usage=chat_pb2.Usage(prompt_tokens=1, completion_tokens=1,
                                                                              total_tokens=2),
            choices=[chat_pb2.ChunkChoice(index=0, delta=chat_pb2.ChatDelta(role="assistant", content="Hello"),
                                          finish_reason=chat_pb2.FINISH_REASON_STOP)]))

    ChatStream = multiplexed_method(_chat, chat_pb2.ChatStreamResponse, chat_pb2.ChatStreamEvent)


@dataclass(frozen=True)
class Pki:
    ca: TestCA
    ours: Pair  # signed by `ca` for the internal server name
    stranger_ca: TestCA
    stranger: Pair  # the same names, signed by another CA

    def tls(self, pair: Pair | None = None, ca: TestCA | None = None, server_name: str = "stormserve.internal"):
        pair, ca = pair or self.ours, ca or self.ca
        return InternalTls(str(pair.cert), str(pair.key), str(ca.cert), server_name)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, stranger_ca = TestCA(directory / "ours"), TestCA(directory / "theirs", name="stranger CA")
    return Pki(ca, ca.issue_internal("service"), stranger_ca, stranger_ca.issue_internal("stranger"))


@asynccontextmanager
async def chat_service(tls: InternalTls, health_port: int = 0) -> AsyncIterator[GrpcService]:
    """A GrpcService with TLS serving the fake ChatService, SERVING."""
    service = GrpcService("chat", "127.0.0.1", 0, 1.0, tls, health_port)
    service.add(chat_pb2_grpc.add_ChatServiceServicer_to_server, FakeChatService(),
                chat_pb2.DESCRIPTOR.services_by_name["ChatService"])
    await service.start()
    await service.set_serving(True)
    try:
        yield service
    finally:
        await service.server.stop(None)
        if service.health_server is not None:
            await service.health_server.stop(None)


async def list_models(chan: grpc.aio.Channel) -> chat_pb2.ListModelsResponse:
    async with chan:
        return await chat_pb2_grpc.ChatServiceStub(chan).ListModels(chat_pb2.ListModelsRequest(), timeout=5)


async def refused(chan: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await list_models(chan)
    return error.value.code()


def test_a_tls_service_serves_a_client_with_a_certificate_from_its_ca_and_no_one_else(pki):
    async def scenario():
        async with chat_service(pki.tls()) as service:
            address = f"127.0.0.1:{service.port}"
            assert (await list_models(channel(address, pki.tls()))).models[0].id == "m"
            no_certificate = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert.read_bytes())
            strangers = {
                "plaintext": grpc.aio.insecure_channel(address),
                "no client certificate": grpc.aio.secure_channel(address, no_certificate,
                                                                 options=pki.tls().channel_options()),
                "a certificate from another CA": channel(address, pki.tls(pki.stranger)),
                "another CA altogether": channel(address, pki.tls(pki.stranger, pki.stranger_ca)),
            }
            for name, chan in strangers.items():
                assert await refused(chan) == grpc.StatusCode.UNAVAILABLE, name
            # The server still serves the right client after all that.
            assert (await list_models(channel(address, pki.tls()))).models

    asyncio.run(scenario())


def test_a_client_refuses_a_server_the_ca_did_not_sign_or_that_has_another_name(pki):
    async def scenario():
        async with chat_service(pki.tls(pki.stranger, pki.stranger_ca)) as impostor:
            assert await refused(channel(f"127.0.0.1:{impostor.port}", pki.tls())) == grpc.StatusCode.UNAVAILABLE
        async with chat_service(pki.tls()) as service:
            renamed = pki.tls(server_name="scheduler.elsewhere")
            assert await refused(channel(f"127.0.0.1:{service.port}", renamed)) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_the_plaintext_health_port_answers_health_and_nothing_else(pki):
    async def scenario():
        async with chat_service(pki.tls(), health_port=free_port()) as service:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}") as chan:
                health = health_pb2_grpc.HealthStub(chan)
                for name in ("", "stormserve.chat.v1.ChatService"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                await service.set_serving(False)  # the same servicer: what the TLS port says, it says
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await refused(grpc.aio.insecure_channel(f"127.0.0.1:{service.health_port}")) == \
                grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(scenario())


def edge_config(pki: Pki, chat_port: int) -> EdgeConfig:
    tls = pki.tls()
    return EdgeConfig(tokenizer_address=f"127.0.0.1:{chat_port}", drain_timeout_s=1,
                      internal_tls_cert_file=tls.cert_file, internal_tls_key_file=tls.key_file,
                      internal_tls_ca_file=tls.ca_file)


def client_context(ca: TestCA, pair: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if pair is not None:
        context.load_cert_chain(str(pair.cert), str(pair.key))
    return context


def test_the_edge_serves_https_and_only_health_and_metrics_without_a_client_certificate(pki):
    async def scenario():
        async with chat_service(pki.tls()) as chat:
            async with serving(build_server(edge_config(pki, chat.port))) as port:
                url = f"https://127.0.0.1:{port}"
                async with httpx.AsyncClient(base_url=url, verify=pki.tls().client_ssl_context(), timeout=10) as ours:
                    assert (await ours.get("/health")).status_code == 200  # it reached the TLS ChatService
                    assert (await ours.get("/v1/models")).json()["data"][0]["id"] == "m"
                    reply = await ours.post("/v1/chat/completions", json=BODY)
                    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello"
                async with httpx.AsyncClient(base_url=url, verify=client_context(pki.ca), timeout=10) as anonymous:
                    assert (await anonymous.get("/health")).status_code == 200
                    assert (await anonymous.get("/metrics")).status_code == 200
                    for reply in (await anonymous.get("/v1/models"), await anonymous.get("/health/"),
                                  await anonymous.post("/v1/chat/completions", json=BODY)):
                        assert reply.status_code == 403
                        assert reply.json()["error_type"] == "Forbidden"
                        assert "client certificate" in reply.json()["message"]
                stranger = client_context(pki.ca, pki.stranger)
                async with httpx.AsyncClient(base_url=url, verify=stranger, timeout=10) as client:
                    with pytest.raises(httpx.TransportError):
                        await client.get("/health")
                async with httpx.AsyncClient(timeout=10) as plaintext:
                    with pytest.raises(httpx.TransportError):
                        await plaintext.get(f"http://127.0.0.1:{port}/v1/models")

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
