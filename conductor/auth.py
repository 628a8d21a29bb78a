"""Optional API keys, as vLLM checks one: `Authorization: Bearer <key>` on the /v1 routes,
and the tenant each key belongs to.

A missing or wrong key gets 401 in OpenAI's error format; other paths (/health, /metrics,
the OpenAPI description) and OPTIONS requests stay open. A key's tenant goes to the request's
scope state (`tenant`); `tenant_salt` turns it into the cache salt that keeps one tenant's
prefixes out of every other's cache hits. Pure ASGI: no per-request objects beyond the header
lookup.
"""

from __future__ import annotations

import hashlib
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from conductor.errors import Unauthorized, error_body

GUARDED_PREFIX = "/v1"

_BODY = json.dumps(error_body(Unauthorized(
    "Missing or invalid API key: send `Authorization: Bearer <key>`."))).encode()


def load_api_keys(path: str, api_key: str = "") -> dict[str, str]:
    """Key -> tenant from `path` (`<key> <tenant>` per line) plus `api_key` (tenant "");
    ValueError for an unreadable file, a line without a tenant, or a key given twice."""
    keys = {api_key: ""} if api_key else {}
    if not path:
        return keys
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise ValueError(f"api_keys_file unreadable: {e}") from e
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, tenant = line.partition(" ")
        if not tenant.strip():
            raise ValueError(f"api_keys_file line {n}: expected '<key> <tenant>'")
        if key in keys:
            raise ValueError(f"api_keys_file line {n}: key given twice")
        keys[key] = tenant.strip()
    return keys


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """The cache salt a request runs with: the client's own without tenants; with one, a
    digest of both, so that equal prompts (and equal client salts) of two tenants never share
    a block."""
    if not tenant:
        return cache_salt or ""
    mixed = hashlib.sha256(f"{tenant}\0{cache_salt or ''}".encode()).hexdigest()
    return f"tenant-{mixed[:32]}"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: dict[str, str]) -> None:
        self.app = app
        self._tenants = {hashlib.sha256(k.encode()).digest(): t for k, t in keys.items()}
        """SHA-256 of each key -> its tenant: looking up a digest leaks nothing usable about
        the keys through timing."""

    def _tenant(self, scope: Scope) -> str | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() != "bearer":
                    return None
                return self._tenants.get(hashlib.sha256(token.strip().encode()).digest())
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith(GUARDED_PREFIX)):
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_BODY)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _BODY})
