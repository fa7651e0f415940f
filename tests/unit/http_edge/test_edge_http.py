"""The HTTP layer against a scripted backend (no gRPC): error bodies, body
limits, SSE framing and cancellation when the client goes away."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from stormserve.chat.v1 import chat_pb2

from services.http_edge import openapi
from services.http_edge.app import create_app
from services.http_edge.backend import ChatBackend
from services.http_edge.config import EdgeConfig

HOLD = object()  # a FakeCall item: block until cancelled
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
JSON = {"content-type": "application/json"}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def text_chunk(content: str, finish: int = 0) -> chat_pb2.ChatChunk:
    return chat_pb2.ChatChunk(
        id="chatcmpl-7", created=1700000000, model="m",
        choices=[chat_pb2.ChunkChoice(delta=chat_pb2.ChatDelta(role="assistant", content=content),
                                      finish_reason=finish)],
    )


class FakeCall:
    """Duck-types grpc.aio.UnaryStreamCall.read/cancel over a script of chunks,
    exceptions and HOLD."""

    def __init__(self, script: list[Any]):
        self.script = list(script)
        self.cancelled = asyncio.Event()

    async def read(self) -> Any:
        if self.cancelled.is_set():
            raise asyncio.CancelledError()
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        if item is HOLD:
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return chat_pb2.ChatResponse(chunk=item)

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class ScriptedBackend(ChatBackend):
    def __init__(self, script: list[Any], models_error: grpc.aio.AioRpcError | None = None):
        super().__init__("unused:1")
        self.script = script
        self.models_error = models_error
        self.calls: list[tuple[chat_pb2.ChatRequest, FakeCall]] = []
        self.metadata: list[dict[str, str] | None] = []  # what each call carried to ChatService

    async def list_models(self, metadata=None) -> list[chat_pb2.Model]:
        self.metadata.append(metadata)
        if self.models_error is not None:
            raise self.models_error
        return [chat_pb2.Model(id="m", root="m", created=1, owned_by="stormserve", max_model_len=64)]

    def chat(self, request: chat_pb2.ChatRequest, timeout_s: float | None,  # type: ignore[override]
             max_buffered_bytes: int | None = None, metadata=None) -> FakeCall:
        self.metadata.append(metadata)
        call = FakeCall(self.script)
        self.calls.append((request, call))
        return call


def make_app(script: list[Any], **config: Any):
    backend = ScriptedBackend(script)
    return create_app(EdgeConfig(**config), backend), backend


def request(app, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def error_body(message: str, error_type: str, code: int) -> dict[str, Any]:
    return {"error": message, "error_type": error_type, "code": code, "result": None, "message": message}


def test_bad_json_is_422_with_the_merged_body() -> None:
    app, backend = make_app([])
    reply = request(app, "POST", "/v1/chat/completions", content=b"{not json", headers=JSON)
    assert reply.status_code == 422
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == error_body(
        "Failed to parse request context to json: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
        "Input Validation Error",
        422,
    )
    assert backend.calls == []


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"}, {"content-type": "application/jsonx"}, {}])
def test_a_body_not_declared_json_is_415_before_it_is_read(headers: dict[str, str]) -> None:
    app, backend = make_app([], max_request_mib=1)
    reply = request(app, "POST", "/v1/chat/completions", content=b"x" * (2 * 1024 * 1024),
                    headers=headers)  # above the limit: a read body would be 413
    assert reply.status_code == 415
    sent = repr(headers["content-type"]) if headers else None
    message = f"Content-Type must be application/json, {f'got {sent}' if sent else 'none was sent'}"
    assert reply.json() == error_body(message, "Unsupported Media Type", 415)
    assert backend.calls == []


def test_json_with_parameters_is_accepted() -> None:
    app, _ = make_app([text_chunk("ok", chat_pb2.FINISH_REASON_STOP)])
    reply = request(app, "POST", "/v1/chat/completions", content=json.dumps(BODY),
                    headers={"content-type": "Application/JSON ; charset=utf-8"})
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "ok"


def test_body_limit_by_declared_length_and_by_counting() -> None:
    limit = 1024 * 1024
    padded = json.dumps(BODY).encode()
    at_limit = padded[:-1] + b" " * (limit - len(padded)) + b"}"
    assert len(at_limit) == limit
    app, _ = make_app([text_chunk("ok", chat_pb2.FINISH_REASON_STOP)], max_request_mib=1)
    assert request(app, "POST", "/v1/chat/completions", content=at_limit, headers=JSON).status_code == 200

    app, backend = make_app([], max_request_mib=1)
    reply = request(app, "POST", "/v1/chat/completions", content=at_limit + b" ", headers=JSON)
    assert reply.status_code == 413
    assert reply.json() == error_body(
        "Request body too large. Maximum allowed size is 1MB.", "Payload Too Large", 413
    )

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted while reading
        for _ in range(3):
            yield b" " * (limit // 2)

    reply = request(app, "POST", "/v1/chat/completions", content=chunked(), headers=JSON)
    assert reply.status_code == 413
    assert backend.calls == []


def test_unknown_route_and_method_use_the_merged_body() -> None:
    app, _ = make_app([])
    missing = request(app, "GET", "/v2/nothing")
    assert (missing.status_code, missing.json()) == (404, error_body("Not Found", "NotFoundError", 404))
    wrong = request(app, "GET", "/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error_type"] == "Method Not Allowed" and wrong.json()["result"] is None


def test_framework_validation_errors_use_the_merged_body() -> None:
    app, _ = make_app([])

    @app.get("/probe")
    async def probe(count: int) -> dict[str, int]:
        return {"count": count}

    reply = request(app, "GET", "/probe", params={"count": "many"})
    assert reply.status_code == 422
    assert reply.json() == error_body("count must be an integer", "Input Validation Error", 422)


def test_unknown_model_is_422_before_any_call() -> None:
    app, backend = make_app([])
    reply = request(app, "POST", "/v1/chat/completions", json={**BODY, "model": "other"})
    assert (reply.status_code, reply.json()) == (422, error_body("Model not found", "Input Validation Error", 422))
    assert backend.calls == []


@pytest.mark.parametrize(
    "code,status", [(grpc.StatusCode.DEADLINE_EXCEEDED, 503), (grpc.StatusCode.UNAVAILABLE, 503),
                    (grpc.StatusCode.INTERNAL, 500)],
)
def test_model_list_failures(code: grpc.StatusCode, status: int) -> None:
    backend = ScriptedBackend([], models_error=rpc_error(code, "no answer"))
    app = create_app(EdgeConfig(), backend)
    for method, path, kwargs in [("POST", "/v1/chat/completions", {"json": BODY}), ("GET", "/v1/models", {})]:
        reply = request(app, method, path, **kwargs)
        assert reply.status_code == status
        assert reply.json()["result"] is None
    assert backend.calls == []


def test_error_chunk_before_any_output_is_an_http_error_even_when_streaming() -> None:
    failed = chat_pb2.ChatChunk(error=chat_pb2.ChatError(code=802, message="Engine callback timeout",
                                                         error_type="Incomplete Generation"))
    app, backend = make_app([failed])
    reply = request(app, "POST", "/v1/chat/completions", json={**BODY, "stream": True})
    assert reply.status_code == 500
    assert reply.json() == error_body("Engine callback timeout", "Incomplete Generation", 802)
    assert backend.calls[0][1].cancelled.is_set()


def test_stream_failure_after_output_is_a_final_error_frame_then_done() -> None:
    app, _ = make_app([text_chunk("Hel"), rpc_error(grpc.StatusCode.UNAVAILABLE, "scheduler went away")])
    reply = request(app, "POST", "/v1/chat/completions", json={**BODY, "stream": True})
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert "content-length" not in reply.headers  # streamed: chunked transfer
    events = reply.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[1].removeprefix("data: ")) == {
        **error_body("the service is temporarily unavailable, retry", "Service Unavailable", 503),
        "finish_reason": "stop",
    }


def test_non_stream_failure_after_output_is_an_http_error() -> None:
    app, _ = make_app([text_chunk("Hel"), rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")])
    reply = request(app, "POST", "/v1/chat/completions", json=BODY)
    assert (reply.status_code, reply.json()) == (500, error_body("the request timed out", "Incomplete Generation", 802))


async def asgi_post(app, body: dict[str, Any], disconnect_when: asyncio.Event) -> list[dict[str, Any]]:
    """Drive the app as an ASGI server would; report http.disconnect once
    `disconnect_when` is set. Returns the messages the app sent."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect_when.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-length", str(len(raw)).encode()),
                                                (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_while_waiting_cancels_the_call(stream: bool) -> None:
    app, backend = make_app([HOLD])

    async def scenario() -> None:
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, gone.set)
        await asgi_post(app, {**BODY, "stream": stream}, gone)
        assert backend.calls[0][1].cancelled.is_set()

    asyncio.run(scenario())


def test_client_disconnect_mid_stream_cancels_the_call_and_stops_writing() -> None:
    app, backend = make_app([text_chunk("one"), HOLD, text_chunk("never")])

    async def scenario() -> None:
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, gone.set)
        sent = await asgi_post(app, {**BODY, "stream": True}, gone)
        call = backend.calls[0][1]
        assert call.cancelled.is_set()
        bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert bodies.count(b"data: ") == 1 and b"[DONE]" not in bodies

    asyncio.run(scenario())


def test_lone_surrogate_is_422_not_500() -> None:
    app, backend = make_app([text_chunk("ok", chat_pb2.FINISH_REASON_STOP)])
    raw = json.dumps({**BODY, "messages": [{"role": "user", "content": "A\ud800B"}]}).encode()
    assert b"\\ud800" in raw  # the escape is valid JSON
    reply = request(app, "POST", "/v1/chat/completions", content=raw, headers=JSON)
    assert (reply.status_code, reply.json()) == (
        422, error_body("messages[0].content is not valid Unicode (a lone surrogate)", "Input Validation Error", 422)
    )
    assert backend.calls == []


def test_duplicate_key_is_422() -> None:
    app, backend = make_app([text_chunk("ok", chat_pb2.FINISH_REASON_STOP)])
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true, "stream": false}'
    reply = request(app, "POST", "/v1/chat/completions", content=raw, headers=JSON)
    assert (reply.status_code, reply.json()) == (
        422, error_body('duplicate key "stream" in the body', "Input Validation Error", 422)
    )
    assert backend.calls == []


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_openapi_describes_the_raw_body_routes() -> None:
    app, _ = make_app([])
    reply = request(app, "GET", "/openapi.json")
    assert reply.status_code == 200
    doc = reply.json()
    assert doc["openapi"].startswith("3.") and doc["info"]["version"] == "0.1.0"
    assert "security" not in doc  # no keys configured
    post = doc["paths"]["/v1/chat/completions"]["post"]
    schema = "#/components/schemas/{}".format
    assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": schema("ChatCompletionRequest")}
    ok = post["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": schema("ChatCompletion")}
    assert {"$ref": schema("ChatCompletionChunk")} in ok["text/event-stream"]["schema"]["oneOf"]
    assert post["responses"]["422"]["content"]["application/json"]["schema"] == {"$ref": schema("ErrorBody")}
    # Every status the edge answers a chat request with, those of its HTTP protocol included.
    assert set(post["responses"]) == {"200", "400", "401", "408", "413", "415", "422", "424", "429", "431", "500",
                                      "503"}
    for path in doc["paths"].values():
        assert {"400", "408", "431"} <= set(path["get" if "get" in path else "post"]["responses"])
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models == {"$ref": schema("ModelList")}
    components = doc["components"]["schemas"]
    assert {r.rsplit("/", 1)[1] for r in _refs(doc)} <= set(components)  # every reference resolves
    assert "HTTPValidationError" not in components  # FastAPI's 422 body is not ours
    request_schema = components["ChatCompletionRequest"]
    assert request_schema["required"] == ["model", "messages"]
    assert {"maximum": 2, "minimum": 0, "type": "number"} in request_schema["properties"]["temperature"]["anyOf"]
    assert components["ChatCompletion"]["properties"]["system_fingerprint"]["type"] == "string"
    assert components["ChatCompletionChunk"]["additionalProperties"] is False
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/health"}


def test_docs_page_and_keyed_openapi() -> None:
    app, _ = make_app([], api_keys=("k1",))
    assert request(app, "GET", "/openapi.json").status_code == 401
    assert request(app, "GET", "/docs").status_code == 401
    keyed = {"Authorization": "Bearer k1"}
    page = request(app, "GET", "/docs", headers=keyed)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text and "'/openapi.json'" in page.text
    doc = request(app, "GET", "/openapi.json", headers=keyed).json()
    assert doc["components"]["securitySchemes"] == {"apiKey": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"apiKey": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []  # probes need no key


def test_docs_assets_are_served_by_the_edge_with_the_docs_key_rule() -> None:
    app, _ = make_app([], api_keys=("k1",))
    keyed = {"Authorization": "Bearer k1"}
    page = request(app, "GET", "/docs", headers=keyed).text
    assert "://" not in page  # no CDN: every URL on the page is the edge's
    assets = openapi.ASSETS_URL
    for name, content_type, first_bytes in [("swagger-ui-bundle.js", "text/javascript; charset=utf-8", b"/*!"),
                                            ("swagger-ui.css", "text/css; charset=utf-8", b".swagger-ui"),
                                            ("favicon.png", "image/png", b"\x89PNG")]:
        assert f"{assets}/{name}" in page
        assert request(app, "GET", f"{assets}/{name}").status_code == 401
        assert request(app, "GET", f"{assets}/{name}", headers={"Authorization": "Bearer k2"}).status_code == 401
        reply = request(app, "GET", f"{assets}/{name}", headers=keyed)
        assert reply.status_code == 200 and reply.content.startswith(first_bytes)
        assert reply.headers["content-type"] == content_type
        assert reply.headers["cache-control"] == "public, max-age=31536000, immutable"
    # Only those three; nothing else of the package's, nor of the disk, and nothing unversioned.
    for path in (f"{assets}/redoc.standalone.js", f"{assets}/../core.py", f"{assets}/%2e%2e%2fcore.py",
                 "/docs/assets/swagger-ui.css", f"{assets}/"):
        assert request(app, "GET", path, headers=keyed).status_code == 404, path


def test_docs_assets_shadow_no_api_route() -> None:
    app, _ = make_app([])
    paths = [route.path for route in app.routes]
    assert [p for p in paths if p.startswith("/docs/")] == [f"{openapi.ASSETS_URL}/{{name}}"]
    assert request(app, "GET", "/docs").status_code == 200
    assert request(app, "GET", "/v1/models").status_code != 404
    assert set(request(app, "GET", "/openapi.json").json()["paths"]) == {
        "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/health"}
