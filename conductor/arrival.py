"""When the server first saw a request: stamped in its ASGI scope by the outermost middleware,
before the API-key check and FastAPI's routing, so that a request's timeline
(`conductor.timeline`) and its TTFT start there rather than at the endpoint's handler (0.2 ms
later on two busy cores)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Receive, Scope, Send

KEY = "kvcluster.arrived"


class Arrival:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[KEY] = time.time()
        await self.app(scope, receive, send)


def arrived(scope: Scope) -> float | None:
    """The wall-clock arrival `Arrival` stamped, if it ran."""
    return scope.get(KEY)
