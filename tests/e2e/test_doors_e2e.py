"""One lock on every door: the real chain with API keys from a key file and Envoy
in front. Every door (REST on the edge; REST, native gRPC, gRPC-Web and
transcoded JSON through Envoy; native gRPC on the tokenizer's own port) gives
the same answer for each key state: none, wrong, right, and revoked by a
rewrite of the key file without a restart. Per-key limits answer 429 /
RESOURCE_EXHAUSTED with a retry delay, health and metrics stay open, and no
error reply on any route names a file, an address or a class."""
from __future__ import annotations

import json
import re
import struct
import threading
import time

import grpc
import httpx
import pytest

from services.common.supervisor import free_port
from services.envoy.config import EnvoyConfig
from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.e2e.conftest import MODEL, running_chain, scrape, total

RIGHT, REVOKED, BURST, RATE = "sk-door-right", "sk-door-revoked", "sk-door-burst", "sk-door-rate"
KEYS = (f"{RIGHT} name=doors\n{REVOKED} name=soon-gone\n"
        f"{BURST} name=burst max_concurrent=1\n{RATE} name=slow requests_per_second=0.2\n")
QUESTION = [{"role": "user", "content": "Say hi."}]
BODY = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "temperature": 0}
PROTO = chat_pb2.ChatRequest(model=MODEL, messages=[chat_pb2.ChatMessage(role="user", content="Say hi.")],
                             max_tokens=2, temperature=0)
UNAUTHENTICATED = 16


@pytest.fixture(scope="module")
def keyed_chain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("doors")
    key_file = directory / "keys"
    key_file.write_text(KEYS)
    envoy = EnvoyConfig(envoy_port=free_port(), envoy_cors_origins=("https://app.example.com",))
    with running_chain(directory, env={"STORMSERVE_API_KEY_FILE": str(key_file)}, envoy=envoy) as (chain, _):
        yield chain, key_file


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


# Each door's answer, as (outcome, message): outcome "ok", or the gRPC code number
# (REST's 401 and 429 read as 16 and 8, with the documented codes checked here).
def rest(url: str, key: str | None, body=BODY) -> tuple[int | str, str]:
    reply = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=120)
    if reply.status_code == 200:
        return "ok", ""
    error = reply.json()
    if reply.status_code == 401:
        assert reply.headers["www-authenticate"] == "Bearer"
        assert error["code"] == (702 if error["message"] == "Authorization not passed" else 801)
        return UNAUTHENTICATED, error["message"]
    assert reply.status_code == 429, reply.text
    assert error["code"] == 429 and error["error_type"] == "Too Many Requests"
    assert 1 <= int(reply.headers["retry-after"]) <= 5
    return 8, error["message"]


def native(address: str, key: str | None) -> tuple[int | str, str]:
    with grpc.insecure_channel(address) as channel:
        try:
            replies = list(chat_pb2_grpc.ChatServiceStub(channel).Chat(PROTO, metadata=tuple(bearer(key).items()),
                                                                        timeout=120))
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert 1 <= int(dict(error.trailing_metadata())["retry-after"]) <= 5
            return error.code().value[0], error.details()
    assert replies
    return "ok", ""


def grpc_web(url: str, key: str | None) -> tuple[int | str, str]:
    message = PROTO.SerializeToString()
    reply = httpx.post(url + "/stormserve.chat.v1.ChatService/Chat", timeout=120,
                       content=b"\x00" + struct.pack(">I", len(message)) + message,
                       headers={"content-type": "application/grpc-web+proto", "x-grpc-web": "1", **bearer(key)})
    assert reply.status_code == 200
    trailers = dict(reply.headers)
    body = reply.content
    while body:  # data frames (flag 0), then the trailer frame (flag 0x80)
        flag, size = body[0], struct.unpack(">I", body[1:5])[0]
        if flag & 0x80:
            for line in body[5:5 + size].decode().split("\r\n"):
                name, _, value = line.partition(":")
                if name:
                    trailers[name.strip().lower()] = value.strip()
        body = body[5 + size:]
    code = int(trailers["grpc-status"])
    return ("ok", "") if code == 0 else (code, httpx.QueryParams(f"m={trailers.get('grpc-message', '')}")["m"])


def transcoded(url: str, key: str | None) -> tuple[int | str, str]:
    reply = httpx.post(url + "/v1/grpc/chat", json={**BODY, "temperature": 0.0}, headers=bearer(key), timeout=120)
    if reply.status_code == 200:
        assert reply.content.startswith(b"data: ")
        return "ok", ""
    status = reply.json()  # the google.rpc.Status as JSON
    assert reply.status_code == {UNAUTHENTICATED: 401, 8: 429}[status["code"]], reply.text
    if status["code"] == 8:
        assert 1 <= int(reply.headers["retry-after"]) <= 5
    return status["code"], status["message"]


def doors(chain) -> dict:
    envoy, tokenizer = chain.envoy_url, f"127.0.0.1:{chain.tokenizer_port}"
    return {
        "REST on the edge": lambda key: rest(chain.url, key),
        "REST through Envoy": lambda key: rest(envoy, key),
        "gRPC through Envoy": lambda key: native(envoy.removeprefix("http://"), key),
        "gRPC-Web through Envoy": lambda key: grpc_web(envoy, key),
        "transcoded through Envoy": lambda key: transcoded(envoy, key),
        "gRPC on the tokenizer's port": lambda key: native(tokenizer, key),
    }


def test_every_door_gives_the_same_answer_for_each_key_state(keyed_chain) -> None:
    chain, key_file = keyed_chain
    expected = {None: (UNAUTHENTICATED, "Authorization not passed"), "sk-wrong": (UNAUTHENTICATED, "Apikey error"),
                RIGHT: ("ok", ""), REVOKED: ("ok", "")}
    for door, call in doors(chain).items():
        for key, answer in expected.items():
            assert call(key) == answer, (door, key)
    key_file.write_text(KEYS.replace(f"{REVOKED} name=soon-gone\n", ""))
    time.sleep(1.5)  # each process looks at the file again at most once a second
    for door, call in doors(chain).items():
        assert call(REVOKED) == (UNAUTHENTICATED, "Apikey error"), door
        assert call(RIGHT) == ("ok", ""), door
    # The model list wants a key on every door too.
    assert httpx.get(chain.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(chain.envoy_url + "/v1/grpc/models", timeout=30).status_code == 401
    models = httpx.get(chain.envoy_url + "/v1/grpc/models", headers=bearer(RIGHT), timeout=30)
    assert models.status_code == 200 and models.json()["models"][0]["root"] == MODEL


def test_health_and_metrics_stay_open(keyed_chain) -> None:
    chain, _ = keyed_chain
    assert httpx.get(chain.url + "/health", timeout=30).status_code == 200
    assert httpx.get(chain.envoy_url + "/health", timeout=30).status_code == 200
    assert httpx.get(chain.url + "/metrics", timeout=30).status_code == 200
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for address in (f"127.0.0.1:{chain.tokenizer_port}", chain.envoy_url.removeprefix("http://")):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_keys_limits_hold_on_every_door_with_a_retry_delay(keyed_chain) -> None:
    chain, _ = keyed_chain
    # One stream holds the burst key's only slot while every door tries it.
    long = {**BODY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    started, tried = threading.Event(), threading.Event()

    def hold() -> None:
        with httpx.stream("POST", chain.url + "/v1/chat/completions", json=long, headers=bearer(BURST),
                          timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if tried.is_set():
                    break  # the disconnect cancels the stream and frees the slot

    holder = threading.Thread(target=hold)
    holder.start()
    assert started.wait(120)
    for door, call in doors(chain).items():
        outcome, message = call(BURST)
        assert (outcome, message) == (8, "API key burst is over its limit of 1 streams at once; retry after 1 s"), door
    tried.set()
    holder.join()
    deadline = time.monotonic() + 30
    while (answer := rest(chain.url, BURST))[0] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)  # the cancel travels to the tokenizer
    assert answer == ("ok", "")
    # 0.2 requests per second: one, then a wait of about 5 s.
    assert rest(chain.url, RATE) == ("ok", "")
    outcome, message = rest(chain.envoy_url, RATE)
    assert outcome == 8 and message.startswith("API key slow is over its limit of 0.2 requests per second")
    samples = scrape(chain.metrics_urls["tokenizer"])[1]
    assert total(samples, "stormserve:api_key_requests_total", key="burst", outcome="concurrency_limited") == 6
    assert total(samples, "stormserve:api_key_tokens_total", key="doors") > 0
    assert not any(secret in str(samples) for secret in (RIGHT, BURST, RATE))


# A reply must not show where things are: paths, addresses, code.
LEAK = re.compile(r"/(?:work|home|root|tmp|usr|opt|var|models|data|etc)/|\.py\b|\.gguf|\.safetensors|Traceback"
                  r"|\b\d{1,3}(?:\.\d{1,3}){3}\b|ipv[46]:|unix:|localhost:\d+|<class|object at 0x|Exception\b"
                  r"|\w+Error\(|File \"")


def test_no_error_reply_on_any_route_names_a_file_an_address_or_a_class(keyed_chain) -> None:
    chain, _ = keyed_chain
    key = bearer(RIGHT)
    envoy = chain.envoy_url
    replies = []
    for url in (chain.url, envoy):
        replies += [
            httpx.post(url + "/v1/chat/completions", content=b"{oops", headers={**key, "content-type":
                                                                                "application/json"}),
            httpx.post(url + "/v1/chat/completions", json={**BODY, "temperature": 9}, headers=key),
            httpx.post(url + "/v1/chat/completions", json={**BODY, "model": "nope"}, headers=key),
            httpx.post(url + "/v1/chat/completions", json={**BODY, "messages": [
                {"role": "user", "content": "word " * 5000}]}, headers=key),
            httpx.post(url + "/v1/chat/completions", content=b"x", headers={**key, "content-type": "text/plain"}),
            httpx.post(url + "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer nope"}),
            httpx.get(url + "/v1/models/nope", headers=key),
            httpx.get(url + "/v1/nothing-here", headers=key),
            httpx.delete(url + "/v1/chat/completions", headers=key),
            httpx.get(url + "/v1/models", headers=key),
        ]
    replies += [
        httpx.post(envoy + "/v1/grpc/chat", json={**BODY, "top_logprobs": 1000, "logprobs": True}, headers=key),
        httpx.post(envoy + "/v1/grpc/chat", json={**BODY, "model": "nope"}, headers=key),
        httpx.post(envoy + "/v1/grpc/chat", content=b"{oops", headers={**key, "content-type": "application/json"}),
        httpx.post(envoy + "/v1/grpc/chat", json={**BODY, "bogus_field": 1}, headers=key),
        httpx.post(envoy + "/v1/grpc/nothing", json={}, headers=key),
        httpx.get(envoy + "/v1/grpc/models", headers=key),
        httpx.get(envoy + "/v1/grpc/models"),
    ]
    assert any(r.status_code == 422 for r in replies) and any(r.status_code == 404 for r in replies)
    for reply in replies:
        text = reply.text + json.dumps(dict(reply.headers))
        assert not LEAK.search(text), (reply.request.method, str(reply.request.url), reply.status_code, text[:500])
    grpc_details = []
    for address in (f"127.0.0.1:{chain.tokenizer_port}", envoy.removeprefix("http://")):
        with grpc.insecure_channel(address) as channel:
            stub = chat_pb2_grpc.ChatServiceStub(channel)
            for request in (chat_pb2.ChatRequest(model="nope", messages=PROTO.messages),
                            chat_pb2.ChatRequest(model=MODEL, messages=PROTO.messages, temperature=float("nan")),
                            chat_pb2.ChatRequest(model=MODEL, messages=PROTO.messages, logprobs=True,
                                                 top_logprobs=1000)):
                with pytest.raises(grpc.RpcError) as raised:
                    list(stub.Chat(request, metadata=tuple(key.items()), timeout=60))
                grpc_details.append(raised.value.details())
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary("/stormserve.chat.v1.ChatService/Nothing")(b"", timeout=30)
            grpc_details.append(raised.value.details() or "")
    assert "top_logprobs must be in [0, 20]" in grpc_details
    assert "temperature must be in [0, 2]" in grpc_details
    for details in grpc_details:
        assert not LEAK.search(details), details
