"""What a client may read of a gRPC status: our own messages for the codes we
raise for clients, a fixed message for anything else or anything the gRPC
library wrote, and never an exception's text."""
from __future__ import annotations

import grpc
import pytest

from google.rpc import error_details_pb2

from services.common.errors import (
    PAYLOAD_TOO_LARGE, ServiceError, client_message, drain_expired, drain_refused, error_reason, status_of,
    status_proto, status_trailers)

# As grpc.aio reports a peer that is down, a socket that broke, an oversized message.
CONNECT_FAILED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50052: "
                  "Failed to connect to remote host: Connection refused")
SOCKET_CLOSED = "Socket closed"
TOO_LARGE = "Received message larger than max (70000000 vs. 67108864)"


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.INVALID_ARGUMENT, "temperature must be at most 2"),
    (grpc.StatusCode.NOT_FOUND, "Model not found: other"),
    (grpc.StatusCode.OUT_OF_RANGE, "This model's maximum input ids length cannot be greater than 2048,"
                                   "the input ids length is 3000"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "the request queue is full"),
    (grpc.StatusCode.ALREADY_EXISTS, "request chatcmpl-1 is already running"),
    (grpc.StatusCode.FAILED_PRECONDITION, "the grammar cannot be compiled"),
    (grpc.StatusCode.UNAUTHENTICATED, "bad key"),
    (grpc.StatusCode.PERMISSION_DENIED, "not allowed"),
])
def test_our_messages_for_clients_pass_through(code, details):
    assert client_message(code, details) == details


@pytest.mark.parametrize("code,details,shown", [
    (grpc.StatusCode.UNAVAILABLE, CONNECT_FAILED, "the service is temporarily unavailable, retry"),
    (grpc.StatusCode.UNAVAILABLE, "the worker running this request was lost",
     "the worker running this request was lost"),
    (grpc.StatusCode.UNAVAILABLE, "no worker is ready", "no worker is ready"),
    (grpc.StatusCode.INTERNAL, "internal error: KeyError: 'x'", "internal error"),
    (grpc.StatusCode.UNKNOWN, "Exception calling application: boom", "internal error"),
    (grpc.StatusCode.DATA_LOSS, "lost", "internal error"),
    (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", "the request was cancelled"),
    (grpc.StatusCode.UNIMPLEMENTED, "Method not found!", "not supported by this server"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "the request timed out"),
])
def test_other_codes_read_as_a_fixed_message_or_the_schedulers_own_words(code, details, shown):
    assert client_message(code, details) == shown


@pytest.mark.parametrize("code,details", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_LARGE),
    (grpc.StatusCode.INVALID_ARGUMENT, "peer ipv6:[::1]:50051 sent garbage"),
    (grpc.StatusCode.NOT_FOUND, "no route to 10.0.0.7:50053"),
    (grpc.StatusCode.FAILED_PRECONDITION, "unix:/tmp/worker.sock: " + SOCKET_CLOSED),
    (grpc.StatusCode.OUT_OF_RANGE, ""),
    (grpc.StatusCode.PERMISSION_DENIED, None),
])
def test_library_details_and_empty_ones_read_as_the_codes_fixed_message(code, details):
    shown = client_message(code, details)
    assert shown and shown != details
    assert "::1" not in shown and "10.0.0.7" not in shown and "unix:" not in shown and "67108864" not in shown


def test_an_unexpected_exception_is_logged_with_the_request_and_answered_without_its_text(caplog):
    code, message = status_of(KeyError("secret-key"), "chatcmpl-7")
    assert (code, message) == (grpc.StatusCode.INTERNAL, "internal error")
    [record] = [r for r in caplog.records if r.exc_info]
    assert "chatcmpl-7" in record.getMessage() and isinstance(record.exc_info[1], KeyError)
    assert status_of(ServiceError(grpc.StatusCode.OUT_OF_RANGE, "too long")) == (
        grpc.StatusCode.OUT_OF_RANGE, "too long")


@pytest.mark.parametrize("details", [drain_refused("tokenizer"), drain_expired("http_edge", 0.5),
                                     drain_expired("worker", 30)])
def test_a_draining_services_own_words_reach_the_client(details):
    assert client_message(grpc.StatusCode.UNAVAILABLE, details) == details
    assert client_message(grpc.StatusCode.UNAVAILABLE, "127.0.0.1:1 " + details) != details


def test_an_error_reason_travels_in_the_status_details() -> None:
    """One refusal code, told apart by its google.rpc.ErrorInfo (the edge's 413)."""
    marked = status_proto(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "too big", PAYLOAD_TOO_LARGE))
    assert (marked.code, marked.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "too big")
    assert error_reason(status_trailers(marked)) == PAYLOAD_TOO_LARGE
    plain = status_proto(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert status_trailers(plain) == () and error_reason(status_trailers(plain)) == ""
    # Another domain's reason (a proxy's, a library's) is not ours to act on.
    foreign = status_proto(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "x"))
    foreign.details.add().Pack(error_details_pb2.ErrorInfo(reason=PAYLOAD_TOO_LARGE, domain="example.com"))
    assert error_reason(status_trailers(foreign)) == ""
    assert error_reason(None) == ""
