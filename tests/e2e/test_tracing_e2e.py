"""OpenTelemetry traces through the real chain: a test OTLP receiver collects
the spans of one request and finds one trace across the four services, each
span with the right parent and attributes, and the worker's step spans linked
to the request's sequence."""
from __future__ import annotations

import secrets

import grpc
import httpx
import openai
import pytest

from stormserve.chat.v1 import chat_pb2, chat_pb2_grpc
from tests.e2e.conftest import MODEL, running_chain
from tests.otlp_receiver import OtlpReceiver

SERVICES = {"stormserve-edge", "stormserve-tokenizer", "stormserve-scheduler", "stormserve-worker"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    with OtlpReceiver() as receiver:
        env = {"STORMSERVE_DTYPE": "float32", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
               "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with running_chain(tmp_path_factory.mktemp("traced"), env=env) as (chain, _):
            yield chain, receiver


def one(spans, service: str, name: str):
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {[(s.service, s.name) for s in spans]}"
    return found[0]


def request_spans(receiver: OtlpReceiver, trace_id: str):
    """The trace's spans once the worker's sequence span (the last to end) is in."""
    receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "sequence" for s in spans)
                      and any(s.trace_id == trace_id and s.name.startswith("POST") for s in spans))
    return receiver.of_trace(trace_id)


def test_one_request_is_one_trace_across_the_four_services(traced):
    chain, receiver = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=chain.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0.5,
        top_p=0.9, stream=True, stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None][0]
    finish_reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]

    spans = request_spans(receiver, trace_id)
    assert {s.service for s in spans} == SERVICES
    edge = one(spans, "stormserve-edge", "POST /v1/chat/completions")
    chat = one(spans, "stormserve-tokenizer", "chat")
    template = one(spans, "stormserve-tokenizer", "chat_template")
    generate = one(spans, "stormserve-scheduler", "generate")
    phases = {name: one(spans, "stormserve-scheduler", name) for name in ("queue", "prefill", "decode")}
    sequence = one(spans, "stormserve-worker", "sequence")

    assert edge.parent_span_id == client_span
    assert chat.parent_span_id == edge.span_id
    assert template.parent_span_id == chat.span_id
    assert generate.parent_span_id == chat.span_id
    assert all(p.parent_span_id == generate.span_id for p in phases.values())
    assert sequence.parent_span_id == generate.span_id
    assert phases["queue"].span.end_time_unix_nano <= phases["prefill"].span.end_time_unix_nano \
        <= phases["decode"].span.end_time_unix_nano

    assert edge.attributes["http.response.status_code"] == 200
    assert edge.attributes["gen_ai.request.model"] == MODEL
    assert edge.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert edge.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert chat.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    g = generate.attributes
    assert (g["gen_ai.request.max_tokens"], g["gen_ai.request.n"]) == (6, 1)
    assert g["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert g["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert (g["gen_ai.usage.input_tokens"], g["gen_ai.usage.output_tokens"]) == (usage.prompt_tokens,
                                                                                 usage.completion_tokens)
    assert 0 < g["gen_ai.latency.time_to_first_token"] <= g["gen_ai.latency.e2e"]
    # Sampled without a seed, the reply may end at 6 tokens or sooner: the span says what the client saw.
    assert g["gen_ai.response.finish_reasons"] == finish_reasons and len(finish_reasons) == 1

    # Steps serve many requests: each is its own span, linked to the sequences it ran.
    steps = receiver.wait_for(lambda all_spans: any(
        s.name == "step" and any(link.span_id.hex() == sequence.span_id for link in s.span.links)
        for s in all_spans))
    linked = [s for s in steps if s.name == "step"
              and any(link.span_id.hex() == sequence.span_id for link in s.span.links)]
    # A prefill step, then one per further token (the last may be sampled by the one before).
    assert len(linked) >= usage.completion_tokens - 1
    assert all(s.service == "stormserve-worker" and s.trace_id != trace_id for s in linked)


def test_a_request_without_traceparent_starts_a_trace_named_in_the_access_log(traced):
    chain, receiver = traced
    reply = httpx.post(chain.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert reply.status_code == 200
    request_id = reply.headers["x-request-id"]
    spans = receiver.wait_for(lambda all_spans: any(
        s.attributes.get("stormserve.request_id") == request_id and s.name.startswith("POST") for s in all_spans))
    edge = next(s for s in spans if s.attributes.get("stormserve.request_id") == request_id
                and s.name.startswith("POST"))
    assert edge.parent_span_id == ""
    assert {s.service for s in request_spans(receiver, edge.trace_id)} == SERVICES
    log = (chain.log_dir / "http_edge.log").read_text()
    assert f"request_id={request_id}" in log and f"trace_id={edge.trace_id}" in log


def test_a_native_grpc_caller_passes_its_trace_context_as_metadata(traced):
    chain, receiver = traced
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    with grpc.insecure_channel(f"127.0.0.1:{chain.tokenizer_port}") as channel:
        replies = list(chat_pb2_grpc.ChatServiceStub(channel).Chat(
            chat_pb2.ChatRequest(model=MODEL, messages=[chat_pb2.ChatMessage(role="user", content="Hi")],
                                 max_tokens=2),
            metadata=[("traceparent", f"00-{trace_id}-{caller_span}-01")], timeout=60))
    assert replies
    spans = request_spans_without_edge(receiver, trace_id)
    chat = one(spans, "stormserve-tokenizer", "chat")
    assert chat.parent_span_id == caller_span
    assert one(spans, "stormserve-scheduler", "generate").parent_span_id == chat.span_id
    assert one(spans, "stormserve-worker", "sequence").trace_id == trace_id


def request_spans_without_edge(receiver: OtlpReceiver, trace_id: str):
    receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "sequence" for s in spans)
                      and any(s.trace_id == trace_id and s.name == "chat" for s in spans))
    return receiver.of_trace(trace_id)
