"""The edge's drain (services/common/drain.py): once SIGTERM came, every new
HTTP request (`/health` included, so probes and load balancers see the edge
not ready) is answered 503 with the error body and `Connection: close`; the
requests already in (streams included) go on. `RefuseWhileDraining` counts
them; `server.DrainingServer` waits for them, then exits."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.drain import Drain
from services.http_edge.errors import unavailable


class RefuseWhileDraining:
    """ASGI middleware: counts HTTP requests in flight on `drain`, and refuses new ones once it drains."""

    def __init__(self, app: ASGIApp, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            error = unavailable(self.drain.refusal())
            error.headers["Connection"] = "close"  # the client's next request goes elsewhere
            await error.response()(scope, receive, send)
            return
        with self.drain.carrying():
            await self.app(scope, receive, send)
