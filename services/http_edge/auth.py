"""API keys at the HTTP edge: `Authorization: Bearer <key>` against the shared
key store (services/common/api_keys.py), which the tokenizer checks too.

The edge answers first, before it reads a body, so an unauthenticated client
cannot make it buffer one; the tokenizer makes the same decision for every
call that reaches ChatService by another door, and applies the per-key
limits, so the edge passes the client's credential on with each call.

The product page requires a bearer key; MindIE has none (reference §4, §9.2),
so the check is off unless keys are configured. Failures use the merged
error body with HTTP 401: 702 "Authorization not passed" when no bearer
token was sent, 801 "Apikey error" when the token matches no key.
"""
from __future__ import annotations

from starlette.requests import Request

from services.common.api_keys import KeyRefused, KeyStore, bearer_token
from services.http_edge.errors import unauthorized


def credential_metadata(request: Request) -> dict[str, str]:
    """What the tokenizer needs to make its own decision: the client's Authorization."""
    header = request.headers.get("authorization")
    return {} if header is None else {"authorization": header}


class ApiKeyCheck:
    """A FastAPI dependency; does nothing when no keys are configured."""

    def __init__(self, keys: KeyStore):
        self.keys = keys

    async def __call__(self, request: Request) -> None:
        try:
            self.keys.lookup(bearer_token(request.headers.get("authorization")))
        except KeyRefused as refused:
            raise unauthorized(refused.message) from None
