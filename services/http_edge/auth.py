"""API keys: `Authorization: Bearer <key>` against the configured keys.

The product page requires a bearer key; MindIE has none (reference §4, §9.2),
so the check is off unless keys are configured. Failures use the merged
error body with HTTP 401: 702 "Authorization not passed" when no bearer
token was sent, 801 "Apikey error" when the token matches no key.
"""
from __future__ import annotations

import hmac
import logging
from pathlib import Path

from starlette.requests import Request

from services.http_edge.config import EdgeConfig
from services.http_edge.errors import CODE_APIKEY, CODE_NOT_AUTHORIZED, UNAUTHORIZED, EdgeError

log = logging.getLogger(__name__)

NOT_PASSED = "Authorization not passed"
WRONG_KEY = "Apikey error"
CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 names the scheme it wants


def unauthorized(code: int, message: str) -> EdgeError:
    return EdgeError(401, UNAUTHORIZED, message, code, headers=CHALLENGE)


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def load_api_keys(config: EdgeConfig) -> tuple[bytes, ...]:
    """The configured keys as UTF-8 bytes. A key file that yields no key is a
    start-up error: silently serving without keys would open the server."""
    keys = list(config.api_keys)
    if config.api_key_file:
        from_file = read_key_file(config.api_key_file)
        if not from_file:
            raise ValueError(f"api_key_file {config.api_key_file} holds no key")
        keys += from_file
    if not keys:
        log.warning("no API keys configured (api_keys / api_key_file): every request is accepted")
    else:
        log.info("API keys required: %d configured", len(keys))
    return tuple(dict.fromkeys(k.encode() for k in keys))


def bearer_token(request: Request) -> bytes | None:
    """The raw bytes of a `Bearer` credential (the scheme is case-insensitive), or None."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token.encode("latin-1")  # Starlette decoded the header bytes as latin-1


def is_known_key(token: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the token's content: every key is compared, no early exit."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


class ApiKeyCheck:
    """A FastAPI dependency; does nothing when no keys are configured."""

    def __init__(self, keys: tuple[bytes, ...]):
        self.keys = keys

    async def __call__(self, request: Request) -> None:
        if not self.keys:
            return
        token = bearer_token(request)
        if token is None:
            raise unauthorized(CODE_NOT_AUTHORIZED, NOT_PASSED)
        if not is_known_key(token, self.keys):
            raise unauthorized(CODE_APIKEY, WRONG_KEY)
