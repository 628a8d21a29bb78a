"""The cluster secret: how the conductor and the workers know each other on the worker plane.

Both read it from a file (`secret_file` in their configs; the embedded launcher writes a
random one per run, `deploy/conductor.sh` one per cluster). It never crosses the network;
from it and a worker's registered address (`host:port`) each side derives:

- the **call token** the conductor sends as `x-kvcluster-token` metadata on every Worker
  call; the worker's `RequireToken` interceptor compares it in constant time and answers
  anything else with UNAUTHENTICATED before a servicer runs. Bound to the address: a token
  that a process registered at another address receives opens no real worker.
- the worker's **proof**: an HMAC over a fresh nonce the conductor sends with a token on a
  `Stats` call, answered in its trailing metadata (by the same interceptor). The conductor
  routes to an instance only once its proof checks and the same reply reports the very
  registration etcd holds (`conductor.registry.Instance.verified`): an address registered in
  etcd by someone without the secret never gets a prompt, and an entry rewritten by someone
  else is not believed.

Not covered: the gRPC health service stays open (it says SERVING or not, nothing else), and
without TLS on the wire (`cluster.plane_tls`) a token can be read off the network together
with the prompts it carries.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

TOKEN_KEY = "x-kvcluster-token"
NONCE_KEY = "x-kvcluster-nonce"
PROOF_KEY = "x-kvcluster-proof"
MIN_BYTES = 16
WORKER_SERVICE = "/kvcluster.v1.Worker/"
LOOPBACK = ("127.0.0.1", "localhost", "::1")

Metadata = tuple[tuple[str, str], ...]


class ClusterSecret:
    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_BYTES:
            raise ValueError(f"the cluster secret must be at least {MIN_BYTES} bytes")
        self._key = secret

    @classmethod
    def load(cls, path: str) -> ClusterSecret | None:
        """The secret in `path` (surrounding whitespace dropped); None for ""; ValueError
        for a file that cannot be read or holds too little."""
        if not path:
            return None
        try:
            text = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"secret_file unreadable: {e}") from e
        return cls(text)

    @staticmethod
    def create(path: Path) -> Path:
        """Write a new random secret to `path`, readable by its owner only."""
        path.touch(mode=0o600)
        path.chmod(0o600)  # a file left by an earlier run keeps its mode otherwise
        path.write_text(secrets.token_urlsafe(32) + "\n")
        return path

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "\x00".join(parts).encode(), hashlib.sha256).hexdigest()

    def token(self, address: str) -> str:
        return self._mac("call", address)

    def metadata(self, address: str) -> Metadata:
        """What every call to the worker at `address` carries."""
        return ((TOKEN_KEY, self.token(address)),)

    def proof(self, address: str, nonce: str) -> str:
        return self._mac("worker", address, nonce)

    def proves(self, address: str, nonce: str, proof: str) -> bool:
        return hmac.compare_digest(self.proof(address, nonce).encode(), proof.encode())


def bind(stub: Any, metadata: Metadata) -> Any:
    """`stub` (a generated gRPC stub) with `metadata` on every call; a call passing its own
    `metadata=` replaces it."""
    for name, method in list(vars(stub).items()):
        if callable(method):
            setattr(stub, name, functools.partial(method, metadata=metadata))
    return stub


def metadata_value(metadata: Any, key: str) -> str:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return ""


class RequireToken(grpc.aio.ServerInterceptor):
    """A worker's server: UNAUTHENTICATED for a Worker call without this worker's token,
    before any servicer runs; a unary call that also carries a nonce is answered with the
    proof in its trailing metadata. Denies everything until `bind` gives it the address the
    worker registered."""

    def __init__(self, secret: ClusterSecret) -> None:
        self.secret = secret
        self._address = ""
        self._expected: bytes | None = None

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong cluster token (x-kvcluster-token)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def bind(self, address: str) -> None:
        self._address = address
        self._expected = self.secret.token(address).encode()

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(WORKER_SERVICE):
            return await continuation(details)
        metadata = details.invocation_metadata
        got = metadata_value(metadata, TOKEN_KEY).encode()
        if self._expected is None or not hmac.compare_digest(got, self._expected):
            log.warning("worker_call_unauthenticated", method=details.method)
            return self._deny
        handler = await continuation(details)
        nonce = metadata_value(metadata, NONCE_KEY)
        if nonce and handler is not None and handler.unary_unary is not None:
            return self._proving(handler, self.secret.proof(self._address, nonce))
        return handler

    @staticmethod
    def _proving(handler: grpc.RpcMethodHandler, proof: str) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            context.set_trailing_metadata(((PROOF_KEY, proof),))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            behavior, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
