"""The edge's /metrics: answers by route and status, and refusals by reason."""
from __future__ import annotations

import asyncio

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.http_edge.test_edge_http import BODY, JSON, make_app, request, rpc_error, text_chunk


def scrape(app) -> dict[tuple[str, frozenset], float]:
    reply = request(app, "GET", "/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def answered(samples, route: str, code: int, method: str = "POST") -> float:
    return samples.get(("stormserve:http_requests_total",
                        frozenset({"method": method, "route": route, "code": str(code)}.items())), 0)


def rejected(samples, reason: str) -> float:
    return samples[("stormserve:requests_rejected_total", frozenset({"reason": reason}.items()))]


def test_answers_and_refusals_are_counted_by_route_status_and_reason() -> None:
    app, _ = make_app([text_chunk("hi", finish=1)],
                      api_keys=("k",))
    auth = {"authorization": "Bearer k", **JSON}
    assert request(app, "POST", "/v1/chat/completions", json=BODY, headers=auth).status_code == 200
    assert request(app, "POST", "/v1/chat/completions", content=b"{", headers=auth).status_code == 422
    assert request(app, "POST", "/v1/chat/completions", json=BODY, headers=JSON).status_code == 401
    assert request(app, "GET", "/no/such/path").status_code in (401, 404)
    samples = scrape(app)
    chat = "/v1/chat/completions"
    assert answered(samples, chat, 200) == 1
    assert answered(samples, chat, 422) == 1
    assert answered(samples, chat, 401) == 1
    assert rejected(samples, "validation") == 1
    assert rejected(samples, "auth") >= 1
    assert rejected(samples, "timeout") == 0
    # Unknown paths share one label value, whatever was asked.
    assert not any("/no/such/path" in dict(labels).get("route", "") for _, labels in samples)
    assert ("stormserve:http_request_duration_seconds_count", frozenset({"route": chat}.items())) in samples


def test_the_e2e_timeout_counts_as_a_timeout_refusal() -> None:
    app, _ = make_app([rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "late")], request_timeout_s=0.001)
    reply = request(app, "POST", "/v1/chat/completions", json=BODY, headers=JSON)
    assert reply.status_code == 500 and reply.json()["code"] == 802
    assert rejected(scrape(app), "timeout") == 1


def test_every_answer_carries_its_request_id_and_one_access_line(caplog) -> None:
    app, backend = make_app([text_chunk("hi", finish=1)])
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with caplog.at_level("INFO", logger="stormserve.access"):
        ok = request(app, "POST", "/v1/chat/completions", json=BODY,
                     headers={**JSON, "traceparent": f"00-{trace}-00f067aa0ba902b7-01"})
        bad = request(app, "POST", "/v1/chat/completions", content=b"{", headers=JSON)
    assert ok.status_code == 200 and bad.status_code == 422
    # The id the client saw is the one the chain got (the tokenizer names the completion after it).
    assert ok.headers["x-request-id"] == backend.calls[0][0].request_id
    assert bad.headers["x-request-id"].startswith("chatcmpl-")
    lines = [r for r in caplog.records if r.name == "stormserve.access"]
    assert [r.fields["status"] for r in lines] == [200, 422]
    first, second = (r.fields for r in lines)
    assert first["request_id"] == ok.headers["x-request-id"] and first["trace_id"] == trace
    assert first["model"] == "m" and first["path"] == "/v1/chat/completions" and first["ttft_ms"] is not None
    assert second["request_id"] == bad.headers["x-request-id"]
    assert second["error_code"] == 422 and second["error_type"] == "Input Validation Error"
    assert f"request_id={first['request_id']}" in lines[0].getMessage()


def test_an_unexpected_error_logs_and_answers_the_request_id_of_its_access_line(caplog) -> None:
    app, _ = make_app([RuntimeError("boom")])

    async def go() -> httpx.Response:
        # Starlette answers the 500 and then re-raises, for the server to see.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.post("/v1/chat/completions", json=BODY, headers=JSON)

    with caplog.at_level("INFO"):
        reply = asyncio.run(go())
    assert reply.status_code == 500 and reply.json()["code"] == 9999
    request_id = reply.headers["x-request-id"]
    (access,) = [r for r in caplog.records if r.name == "stormserve.access"]
    assert access.fields["request_id"] == request_id and access.fields["status"] == 500
    (error,) = [r for r in caplog.records if r.exc_info]
    assert error.exc_info[0] is RuntimeError and error.levelname == "ERROR"
    assert error.fields == {"request_id": request_id} and f"request_id={request_id}" in error.getMessage()


def test_json_log_lines_hold_the_fields() -> None:
    import json
    import logging

    from services.common.log import JsonFormatter

    record = logging.LogRecord("stormserve.access", logging.INFO, __file__, 1, "POST %s", ("/x",), None)
    record.fields = {"status": 200, "request_id": "chatcmpl-1"}
    line = json.loads(JsonFormatter("http_edge").format(record))
    assert line["msg"] == "POST /x" and line["service"] == "http_edge"
    assert line["status"] == 200 and line["request_id"] == "chatcmpl-1" and line["level"] == "INFO"
