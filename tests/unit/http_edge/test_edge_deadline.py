"""The e2e deadline, without a server."""
from __future__ import annotations

import time

import grpc
import pytest

from services.http_edge.errors import EdgeError
from services.http_edge.serving import Deadline


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Deadline Exceeded")


def test_deadline_counts_from_its_creation() -> None:
    assert Deadline(None).remaining_s() is None
    deadline = Deadline(0.2)
    remaining = deadline.remaining_s()
    assert remaining is not None and 0.1 < remaining <= 0.2
    time.sleep(0.25)
    with pytest.raises(EdgeError) as caught:
        deadline.remaining_s()
    assert (caught.value.status, caught.value.code) == (500, 802)
    assert caught.value.message == "Request timeout: no complete reply within e2eTimeout (0.2 s)"


def test_only_our_own_passed_deadline_reads_as_the_e2e_timeout() -> None:
    expired = Deadline(0.01)
    time.sleep(0.02)
    assert expired.rpc_error(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)).message.startswith("Request timeout")
    assert expired.rpc_error(rpc_error(grpc.StatusCode.INTERNAL)).code == 9999
    # A DEADLINE_EXCEEDED from further back, well before our deadline: mapped, in our words.
    early = Deadline(60).rpc_error(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert (early.code, early.message) == (802, "the request timed out")
