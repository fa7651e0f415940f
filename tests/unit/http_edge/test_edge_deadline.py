"""API-key loading and matching, and the e2e deadline, without a server."""
from __future__ import annotations

import time

import grpc
import pytest
from starlette.requests import Request

from services.common.config import load_config
from services.http_edge.auth import bearer_token, is_known_key, load_api_keys, read_key_file
from services.http_edge.config import EdgeConfig
from services.http_edge.errors import EdgeError
from services.http_edge.serving import Deadline


def with_headers(*headers: tuple[bytes, bytes]) -> Request:
    return Request({"type": "http", "headers": list(headers)})


def test_keys_come_from_the_environment_and_a_file_and_stay_out_of_repr(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("  sk-file-1  \n# a comment\n\nsk-file-2\nsk-env-1\n")
    config = load_config(EdgeConfig, ["--api-key-file", str(key_file)],
                         {"STORMSERVE_API_KEYS": "sk-env-1, sk-env-2,"})
    assert config.api_keys == ("sk-env-1", "sk-env-2")
    assert "sk-env" not in repr(config)
    assert read_key_file(str(key_file)) == ["sk-file-1", "sk-file-2", "sk-env-1"]
    assert load_api_keys(config) == (b"sk-env-1", b"sk-env-2", b"sk-file-1", b"sk-file-2")


def test_no_keys_is_open_but_an_empty_or_missing_key_file_refuses_to_start(tmp_path, caplog) -> None:
    assert load_api_keys(EdgeConfig()) == ()
    assert "no API keys configured" in caplog.text
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(EdgeConfig(api_key_file=str(empty)))
    with pytest.raises(FileNotFoundError):
        load_api_keys(EdgeConfig(api_key_file=str(tmp_path / "missing")))


@pytest.mark.parametrize("keys", [("",), ("two words",), ("tab\there",)])
def test_unusable_keys_are_a_config_error(keys) -> None:
    with pytest.raises(ValueError, match="api_keys"):
        EdgeConfig(api_keys=keys)


@pytest.mark.parametrize("header,token", [
    (None, None),
    (b"Bearer sk-1", b"sk-1"),
    (b"bearer sk-1", b"sk-1"),
    (b"BEARER   sk-1  ", b"sk-1"),
    (b"Bearer", None),
    (b"Bearer   ", None),
    (b"Basic c2stMQ==", None),
    (b"sk-1", None),
    ("Bearer ключ".encode(), "ключ".encode()),  # raw UTF-8 bytes survive Starlette's latin-1 decoding
])
def test_bearer_token(header, token) -> None:
    request = with_headers() if header is None else with_headers((b"authorization", header))
    assert bearer_token(request) == token


def test_key_match_is_exact() -> None:
    keys = (b"sk-alpha", b"sk-beta")
    assert is_known_key(b"sk-beta", keys) and is_known_key(b"sk-alpha", keys)
    for token in (b"sk-bet", b"sk-betaa", b"SK-BETA", b"", b"sk-alpha\x00"):
        assert not is_known_key(token, keys)
    assert not is_known_key(b"sk-alpha", ())


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
