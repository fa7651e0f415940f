"""The API keys every door checks: one store, read from the same settings by
the HTTP edge and the tokenizer (whose ChatService every gRPC, gRPC-Web and
transcoded call reaches), so that one decision holds wherever a call comes in.

Keys come from `api_keys` (a comma list) and `api_key_file`, one line per key:

    # comment
    sk-team-a-123 name=team-a requests_per_second=5 max_concurrent=4 tokens_per_minute=60000
    sk-batch-456,sk-batch-789 name=batch

A line's first word is a key, or a comma list of keys sharing the settings that
follow; every setting is optional. A key without `name=` is named `key-` and
the first 8 hex digits of its SHA-256: the name is what logs and metrics show,
never the key. Only SHA-256 digests are kept in memory; a presented key is
hashed and compared with every digest in constant time.

The file is read again when it changes (at most once a second, on a lookup),
so a key is added or revoked without a restart; a reload that fails or yields
no key keeps the keys in force and logs why.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.config import require, setting

log = logging.getLogger(__name__)

NOT_PASSED = "Authorization not passed"
WRONG_KEY = "Apikey error"
RECHECK_S = 1.0


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; 0 means none."""

    requests_per_second: float = 0.0
    max_concurrent: int = 0
    tokens_per_minute: int = 0

    @property
    def is_limited(self) -> bool:
        return bool(self.requests_per_second or self.max_concurrent or self.tokens_per_minute)


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = dataclasses.field(repr=False)
    limits: KeyLimits = KeyLimits()


class KeyRefused(Exception):
    """No key, or one that matches none; `message` is NOT_PASSED or WRONG_KEY."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def check_api_keys(keys: Iterable[str]) -> None:
    require(all(k and not any(c.isspace() or c == "," for c in k) for k in keys),
            "api_keys must be non-empty and hold no whitespace or comma")


@dataclass(frozen=True)
class ApiKeySettings:
    """The settings of the services that check keys (the edge, the tokenizer):
    their configs inherit them, so both read the same names."""

    # Not `setting(...)`: keys must never reach a log line or a traceback, so the
    # field is hidden from repr.
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False, metadata={
        "help": "comma list of accepted `Authorization: Bearer` keys; none (and no api_key_file) means no check",
        "alias": None})
    api_key_file: str = setting("", "file of accepted API keys, one per line with optional per-key name and "
                                    "limits (docs: security); read again when it changes; adds to api_keys")

    def __post_init__(self) -> None:
        check_api_keys(self.api_keys)


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


_LIMIT_TYPES: dict[str, Callable[[str], float | int]] = {
    "requests_per_second": float, "max_concurrent": int, "tokens_per_minute": int}


def parse_key_line(line: str, where: str) -> list[ApiKey]:
    """The keys of one line of a key file (none for a blank or comment line)."""
    words = line.split()
    if not words or words[0].startswith("#"):
        return []
    keys = [k for k in words[0].split(",") if k]
    require(bool(keys), f"{where}: no key before the settings")
    name, limits = "", {}
    for word in words[1:]:
        field, sep, value = word.partition("=")
        require(bool(sep and value), f"{where}: {word!r} is not name=value")
        if field == "name":
            require(all(c.isalnum() or c in "_.-" for c in value) and len(value) <= 64,
                    f"{where}: a name is 1-64 characters of [A-Za-z0-9_.-]")
            name = value
            continue
        require(field in _LIMIT_TYPES, f"{where}: unknown setting {field!r} (name, {', '.join(_LIMIT_TYPES)})")
        try:
            limits[field] = _LIMIT_TYPES[field](value)
        except ValueError:
            raise ValueError(f"{where}: {field} must be a number, got {value!r}") from None
        require(limits[field] >= 0, f"{where}: {field} must be >= 0")
    return [ApiKey(name or default_name(key), digest(key.encode()), KeyLimits(**limits)) for key in keys]


def default_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def read_key_file(path: str) -> list[ApiKey]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [key for number, line in enumerate(lines, 1) for key in parse_key_line(line, f"{path}:{number}")]


def _file_version(path: str) -> tuple[int, int, int]:
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_ino, stat.st_size


class KeyStore:
    """The accepted keys, by digest; empty means every caller is accepted."""

    def __init__(self, keys: Iterable[str] = (), key_file: str = "", clock: Callable[[], float] = time.monotonic):
        self._fixed = [ApiKey(default_name(k), digest(k.encode())) for k in keys]
        self._file = key_file
        self._clock = clock
        self._checked_at = clock()
        self._version = None
        self._keys: tuple[ApiKey, ...] = tuple(self._fixed)
        if key_file:
            self._version = _file_version(key_file)
            from_file = read_key_file(key_file)
            require(bool(from_file), f"api_key_file {key_file} holds no key")
            self._keys = (*self._fixed, *from_file)
        if self._keys:
            log.info("API keys required: %d configured", len(self._keys))
        else:
            log.warning("no API keys configured (api_keys / api_key_file): every request is accepted")

    @classmethod
    def from_config(cls, config) -> KeyStore:
        """From a config with the `api_keys` and `api_key_file` settings."""
        return cls(config.api_keys, config.api_key_file)

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def _reload_if_changed(self) -> None:
        now = self._clock()
        if not self._file or now - self._checked_at < RECHECK_S:
            return
        self._checked_at = now
        try:
            version = _file_version(self._file)
            if version == self._version:
                return
            from_file = read_key_file(self._file)
            require(bool(from_file), "it holds no key")
        except (OSError, ValueError) as exc:
            log.error("api_key_file %s not reloaded, the keys in force stay: %s", self._file, exc)
            return
        self._version = version
        self._keys = (*self._fixed, *from_file)
        log.info("api_key_file %s reloaded: %d keys", self._file, len(self._keys))

    def lookup(self, token: bytes | None) -> ApiKey | None:
        """The key `token` is, None when no keys are configured; KeyRefused otherwise.
        Every digest is compared, with no early exit."""
        self._reload_if_changed()
        if not self._keys:
            return None
        if not token:
            raise KeyRefused(NOT_PASSED)
        presented = digest(token)
        found = None
        for key in self._keys:
            if hmac.compare_digest(presented, key.digest):
                found = key
        if found is None:
            raise KeyRefused(WRONG_KEY)
        return found


def bearer_token(authorization: str | None) -> bytes | None:
    """The credential of an `Authorization: Bearer <token>` value (the scheme in any case), or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("latin-1", errors="replace")  # HTTP header bytes, as Starlette decodes them


def metadata_token(metadata: Mapping[str, str] | Iterable[tuple[str, str | bytes]]) -> bytes | None:
    """The bearer credential in gRPC metadata (keys are lower case there)."""
    items = metadata.items() if isinstance(metadata, Mapping) else metadata
    for key, value in items:
        if key == "authorization" and isinstance(value, str):
            return bearer_token(value)
    return None
