"""Optional API key, as vLLM checks it: `Authorization: Bearer <key>` on the /v1 routes.

A missing or wrong key gets 401 in OpenAI's error format; other paths (/health, /metrics,
the OpenAPI description) and OPTIONS requests stay open. Pure ASGI: no per-request objects
beyond the header lookup.
"""

from __future__ import annotations

import hashlib
import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from conductor.errors import Unauthorized, error_body

GUARDED_PREFIX = "/v1"

_BODY = json.dumps(error_body(Unauthorized(
    "Missing or invalid API key: send `Authorization: Bearer <key>`."))).encode()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return False
                return secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                                              self._digest)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith(GUARDED_PREFIX) or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_BODY)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})
