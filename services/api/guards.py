"""What every request passes before its route: the API key check, the drain gate, the in-flight count.

A pure ASGI middleware, so a streamed response counts as in flight until its last byte.
"""

from __future__ import annotations

import hmac
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from services.api.context import ApiContext
from services.api.errors import APIError

OPEN_PATHS = ("/health", "/ready", "/live")  # answers without a key: load balancers and orchestrators probe it


def is_valid_key(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every configured key (no early exit on the first match)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    given = authorization[len("Bearer "):].encode()
    matches = [hmac.compare_digest(given, key.encode()) for key in keys]
    return any(matches)


def arrival(request: Request) -> tuple[float, float]:
    """(monotonic, wall clock) when the request reached the gateway: the clock of its TTFT and of
    the latency breakdown starts before its body is read, parsed and tokenized."""
    return request.state.arrival if hasattr(request.state, "arrival") else (time.monotonic(), time.time())


class Guards:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = (time.monotonic(), time.time())
        ctx: ApiContext = scope["app"].state.ctx
        path = scope["path"]
        if ctx.server.api_keys and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not is_valid_key(auth, ctx.server.api_keys):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                return await error.response()(scope, receive, send)
        if ctx.server.is_draining and path not in OPEN_PATHS:
            return await APIError(503, "the server is shutting down", code="draining").response()(scope, receive, send)
        ctx.server.num_in_flight += 1
        ctx.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            ctx.server.num_in_flight -= 1
            ctx.metrics.in_flight.dec()
