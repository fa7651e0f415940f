"""EdgeConfig validation and flag/env/alias loading; the gRPC -> HTTP error table."""
from __future__ import annotations

import grpc
import pytest

from services.common.config import load_config
from services.http_edge.config import EdgeConfig
from services.common.validation import describe_error, field_path
from services.http_edge.errors import from_chat_error, from_grpc


def test_defaults() -> None:
    config = load_config(EdgeConfig, [], {})
    assert (config.host, config.port, config.tokenizer_address) == ("127.0.0.1", 8000, "127.0.0.1:50051")
    assert config.max_request_mib == 40 and config.max_request_bytes == 40 * 1024 * 1024
    assert config.request_timeout_s == 600
    assert (config.max_header_kib, config.max_header_bytes, config.max_headers) == (32, 32 * 1024, 100)
    assert (config.header_timeout_s, config.body_timeout_s) == (10, 30)


def test_http_limits_from_flags_and_environment() -> None:
    config = load_config(
        EdgeConfig,
        ["--max-header-kib", "8", "--header-timeout-s", "0.5"],
        {"STORMSERVE_MAX_HEADERS": "20", "STORMSERVE_BODY_TIMEOUT_S": "2.5", "STORMSERVE_MAX_HEADER_KIB": "64"},
    )
    assert (config.max_header_bytes, config.max_headers) == (8 * 1024, 20)
    assert (config.header_timeout_s, config.body_timeout_s) == (0.5, 2.5)


def test_flags_aliases_and_environment() -> None:
    config = load_config(
        EdgeConfig,
        ["--port", "9001", "--maxRequestLength", "2", "--tokenizer-address", "tok:1"],
        {"STORMSERVE_REQUEST_TIMEOUT_S": "30", "STORMSERVE_PORT": "1"},
    )
    assert (config.port, config.max_request_mib, config.tokenizer_address) == (9001, 2, "tok:1")
    assert config.request_timeout_s == 30
    assert load_config(EdgeConfig, ["--e2eTimeout", ""], {}).request_timeout_s is None


@pytest.mark.parametrize(
    "fields",
    [
        {"port": 70000},
        {"port": -1},
        {"host": ""},
        {"tokenizer_address": "no-port"},
        {"tokenizer_address": ":50051"},
        {"max_request_mib": 0},
        {"max_request_mib": 101},
        {"request_timeout_s": 0},
        {"request_timeout_s": 70000},
        {"models_cache_s": -1},
        {"drain_timeout_s": -0.5},
        {"max_header_kib": 0},
        {"max_header_kib": 1025},
        {"max_headers": 0},
        {"max_headers": 10_001},
        {"header_timeout_s": 0},
        {"header_timeout_s": float("nan")},
        {"header_timeout_s": float("inf")},
        {"body_timeout_s": -1},
        {"body_timeout_s": 70000},
    ],
)
def test_invalid_config_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        EdgeConfig(**fields)


@pytest.mark.parametrize(
    "code,status,error_type,doc_code,message",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 422, "Input Validation Error", 422, "details here"),
        (grpc.StatusCode.NOT_FOUND, 422, "Input Validation Error", 422, "details here"),
        (grpc.StatusCode.OUT_OF_RANGE, 424, "Generation Error", 9999, "details here"),
        (grpc.StatusCode.UNAVAILABLE, 503, "Service Unavailable", 503,
         "the service is temporarily unavailable, retry"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "Service Unavailable", 503, "details here"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 500, "Incomplete Generation", 802, "the request timed out"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "Unauthorized", 801, "details here"),
        (grpc.StatusCode.PERMISSION_DENIED, 401, "Unauthorized", 702, "details here"),
        (grpc.StatusCode.INTERNAL, 500, "Incomplete Generation", 9999, "internal error"),
        (grpc.StatusCode.UNKNOWN, 500, "Incomplete Generation", 9999, "internal error"),
    ],
)
def test_grpc_status_mapping(code, status, error_type, doc_code, message) -> None:
    error = from_grpc(code, "details here")
    assert (error.status, error.error_type, error.code) == (status, error_type, doc_code)
    assert error.body() == {
        "error": message,
        "error_type": error_type,
        "code": doc_code,
        "result": None,
        "message": message,
    }


def test_the_tokenizers_key_refusals_read_as_the_edges_own() -> None:
    missing = from_grpc(grpc.StatusCode.UNAUTHENTICATED, "Authorization not passed")
    wrong = from_grpc(grpc.StatusCode.UNAUTHENTICATED, "Apikey error")
    assert [(e.status, e.code, e.headers) for e in (missing, wrong)] == [
        (401, 702, {"WWW-Authenticate": "Bearer"}), (401, 801, {"WWW-Authenticate": "Bearer"})]
    limited = from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "API key a is over its limit", "RATE_LIMITED", 7)
    assert (limited.status, limited.code, limited.error_type, limited.headers) == (
        429, 429, "Too Many Requests", {"Retry-After": "7"})
    assert limited.message == "API key a is over its limit"
    # The server's own overload (a full queue) stays 503.
    assert from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full").status == 503


def test_chat_error_defaults() -> None:
    error = from_chat_error(0, "", "")
    assert (error.status, error.code, error.error_type) == (500, 9999, "Incomplete Generation")
    timeout = from_chat_error(802, "Engine callback timeout", "Incomplete Generation")
    assert (timeout.status, timeout.code, timeout.message) == (500, 802, "Engine callback timeout")


def test_field_path_drops_union_tags() -> None:
    assert field_path(("messages", 0, "content", "<list>", 2, "text")) == "messages[0].content[2].text"
    assert field_path(()) == ""
    assert describe_error({"type": "missing", "loc": ("model",), "msg": "Field required"}) == "model is required"
    assert describe_error({"type": "request_rule", "loc": (), "msg": "whole-request rule"}) == "whole-request rule"
