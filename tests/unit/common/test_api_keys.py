"""The shared key store: keys from the environment and a file with per-key
names and limits, only digests kept, exact matches, and a file read again when
it changes (a key revoked without a restart)."""
from __future__ import annotations

import os

import pytest

from services.common.api_keys import (
    NOT_PASSED, RECHECK_S, WRONG_KEY, KeyLimits, KeyRefused, KeyStore, bearer_token, default_name,
    metadata_token, read_key_file)
from services.common.config import load_config
from services.http_edge.config import EdgeConfig
from services.tokenizer.config import TokenizerConfig


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lookup(store: KeyStore, key: str):
    return store.lookup(key.encode())


def refusal(store: KeyStore, token: bytes | None) -> str:
    with pytest.raises(KeyRefused) as refused:
        store.lookup(token)
    return refused.value.message


@pytest.mark.parametrize("config_class", [EdgeConfig, TokenizerConfig])
def test_both_doors_read_the_same_settings_and_never_show_a_key(config_class, tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-file-1\n")
    config = load_config(config_class, ["--api-key-file", str(key_file)],
                         {"STORMSERVE_API_KEYS": "sk-env-1, sk-env-2,"})
    assert config.api_keys == ("sk-env-1", "sk-env-2")
    assert "sk-env" not in repr(config)
    store = KeyStore.from_config(config)
    assert {lookup(store, k).name for k in ("sk-env-1", "sk-env-2", "sk-file-1")} == {
        default_name("sk-env-1"), default_name("sk-env-2"), default_name("sk-file-1")}


def test_a_key_file_names_keys_and_gives_them_limits(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("  sk-a  name=team-a requests_per_second=2.5 max_concurrent=3 tokens_per_minute=600\n"
                        "# a comment\n\n"
                        "sk-b1,sk-b2 name=batch\n"
                        "sk-c\n")
    keys = read_key_file(str(key_file))
    assert [(k.name, k.limits) for k in keys] == [
        ("team-a", KeyLimits(2.5, 3, 600)), ("batch", KeyLimits()), ("batch", KeyLimits()),
        (default_name("sk-c"), KeyLimits())]
    assert default_name("sk-c").startswith("key-") and "sk-c" not in default_name("sk-c")
    store = KeyStore(key_file=str(key_file))
    assert lookup(store, "sk-b2").name == "batch"
    assert lookup(store, "sk-a").limits.max_concurrent == 3


@pytest.mark.parametrize(("line", "error"), [
    ("sk-a speed=3", "unknown setting 'speed'"),
    ("sk-a max_concurrent=two", "max_concurrent must be a number"),
    ("sk-a tokens_per_minute=-1", "tokens_per_minute must be >= 0"),
    ("sk-a name", "is not name=value"),
    ("sk-a name=a/b", "a name is 1-64 characters"),
    (", name=x", "no key before the settings"),
])
def test_a_bad_line_is_a_start_up_error_naming_the_line(tmp_path, line, error) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"sk-ok\n{line}\n")
    with pytest.raises(ValueError, match=error) as raised:
        KeyStore(key_file=str(key_file))
    assert f"{key_file}:2" in str(raised.value)


def test_no_keys_is_open_but_an_empty_or_missing_key_file_refuses_to_start(tmp_path, caplog) -> None:
    assert KeyStore().lookup(None) is None and not KeyStore().is_enabled
    assert "no API keys configured" in caplog.text
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        KeyStore(key_file=str(empty))
    with pytest.raises(FileNotFoundError):
        KeyStore(key_file=str(tmp_path / "missing"))


@pytest.mark.parametrize("keys", [("",), ("two words",), ("tab\there",), ("a,b",)])
def test_unusable_keys_are_a_config_error(keys) -> None:
    with pytest.raises(ValueError, match="api_keys"):
        EdgeConfig(api_keys=keys)


def test_a_key_matches_exactly_and_only_its_digest_is_kept() -> None:
    store = KeyStore(("sk-alpha", "sk-beta"))
    assert lookup(store, "sk-beta").name == default_name("sk-beta")
    for token in (b"sk-bet", b"sk-betaa", b"SK-BETA", b"sk-alpha\x00"):
        assert refusal(store, token) == WRONG_KEY
    assert refusal(store, None) == NOT_PASSED
    assert refusal(store, b"") == NOT_PASSED
    held = repr(vars(store)) + "".join(repr(k) for k in store._keys)
    assert "sk-alpha" not in held and "sk-beta" not in held


def test_the_file_is_read_again_when_it_changes_and_a_bad_version_keeps_the_keys(tmp_path, caplog) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-old name=old\n")
    clock = Clock()
    store = KeyStore(("sk-env",), str(key_file), clock)
    assert lookup(store, "sk-old").name == "old"
    key_file.write_text("sk-new name=new max_concurrent=1\n")
    os.utime(key_file, ns=(1, 1))  # a different version even within the file system's time resolution
    assert lookup(store, "sk-old").name == "old"  # not looked at again within RECHECK_S
    clock.now += RECHECK_S
    assert refusal(store, b"sk-old") == WRONG_KEY  # revoked, no restart
    assert lookup(store, "sk-new").limits.max_concurrent == 1
    assert lookup(store, "sk-env")  # the environment's keys stay
    key_file.write_text("sk-newer bogus=1\n")
    clock.now += RECHECK_S
    assert lookup(store, "sk-new").name == "new"
    assert "not reloaded, the keys in force stay" in caplog.text
    key_file.unlink()
    clock.now += RECHECK_S
    assert lookup(store, "sk-new").name == "new"


@pytest.mark.parametrize("header,token", [
    (None, None),
    ("Bearer sk-1", b"sk-1"),
    ("bearer sk-1", b"sk-1"),
    ("BEARER   sk-1  ", b"sk-1"),
    ("Bearer", None),
    ("Bearer   ", None),
    ("Basic c2stMQ==", None),
    ("sk-1", None),
    ("Bearer ключ".encode().decode("latin-1"), "ключ".encode()),  # UTF-8 bytes as Starlette decodes them
])
def test_bearer_token(header, token) -> None:
    assert bearer_token(header) == token
    metadata = () if header is None else (("authorization", header),)
    assert metadata_token(metadata) == token
    assert metadata_token(dict(metadata)) == token
