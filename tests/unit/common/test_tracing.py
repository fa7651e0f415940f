"""When the OTEL_* environment turns tracing on, and the W3C context helpers."""
from __future__ import annotations

import pytest

from services.common import tracing


@pytest.mark.parametrize("environ, on", [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False),
])
def test_tracing_is_on_only_when_the_environment_asks(environ, on):
    assert tracing.configured(environ) is on


@pytest.mark.parametrize("environ", [
    {"OTEL_TRACES_EXPORTER": "zipkin"},
    {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
])
def test_an_exporter_we_do_not_ship_is_refused_at_start(environ):
    with pytest.raises(SystemExit, match="only"):
        tracing.configured(environ) and tracing.setup("test", environ)


def test_off_costs_nothing_on_the_request_path():
    assert not tracing.enabled  # the test process never set it up
    assert tracing.inject() == {}
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    with tracing.span("x") as span:
        assert span is None


def test_a_traceparent_names_its_span_and_a_bad_one_nothing():
    ctx = tracing.span_context_of("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
    assert (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")) == ("ab" * 16, "cd" * 8)
    assert tracing.span_context_of("00-zz-yy-01") is None
