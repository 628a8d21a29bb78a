"""How a process reaches etcd: the endpoint, and the TLS and user a deployment turned on.

An access file (TOML; `--etcd-access-file`, the same file on every node) names them:

    ca_file = "ca.pem"            # TLS: the CA that signed etcd's certificate
    cert_file = "client.pem"      # mutual TLS (etcd --client-cert-auth): this node's
    key_file = "client-key.pem"   #   certificate and key
    user = "kvcluster"            # etcd auth: this user (etcd's `auth enable`) ...
    password_file = "etcd.pw"     #   ... with its password in this file

Relative paths are relative to the access file; every file is read once, here. No file: plain
etcd without auth (the embedded cluster's, on loopback). `deploy/etcd.sh` turns TLS and auth
on and writes such a file (`cluster.certs` makes the certificates).

Surprise: aetcd (1.0) opens insecure channels only; `_Client` is aetcd's client with a TLS
channel, the rest of aetcd's `connect` as it is.
"""

from __future__ import annotations

import asyncio
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
from aetcd import rpc, watcher
from aetcd.client import _handle_errors  # aetcd's grpc -> aetcd error mapping

if TYPE_CHECKING:
    from cluster.certs import CertFiles

_KEYS = {"ca_file", "cert_file", "key_file", "user", "password_file"}


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (an `http://` or `https://` prefix allowed) -> (host, port)."""
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise ValueError(f"etcd endpoint must be host:port, not {endpoint!r}")
    return host, int(port)


@dataclass(frozen=True)
class EtcdAccess:
    """An etcd endpoint and the credentials to use there (none: plain, unauthenticated)."""

    endpoint: str
    ca: bytes | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    user: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        split_endpoint(self.endpoint)
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd access: cert_file and key_file go together")
        if self.cert is not None and self.ca is None:
            raise ValueError("etcd access: a client certificate needs ca_file (TLS)")
        if bool(self.user) != bool(self.password):
            raise ValueError("etcd access: user and password_file go together")

    @classmethod
    def load(cls, endpoint: str, path: str = "") -> EtcdAccess:
        """The access `path` (an access file, see the module) gives to `endpoint`; "" none.
        ValueError names what is wrong with the file."""
        if not path:
            return cls(endpoint)
        base = Path(path).parent
        try:
            spec = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"etcd access file {path}: {e}") from e
        unknown = set(spec) - _KEYS
        if unknown:
            raise ValueError(f"etcd access file {path}: unknown keys {sorted(unknown)}")

        def read(name: str) -> bytes | None:
            if not spec.get(name):
                return None
            try:
                return (base / str(spec[name])).read_bytes()
            except OSError as e:
                raise ValueError(f"etcd access file {path}: {name}: {e}") from e

        password = read("password_file")
        return cls(endpoint, ca=read("ca_file"), cert=read("cert_file"), key=read("key_file"),
                   user=str(spec.get("user", "")),
                   password=password.decode().strip() if password else "")

    @classmethod
    def from_certs(cls, endpoint: str, files: CertFiles | None) -> EtcdAccess:
        """TLS with `cluster.certs` files (the client pair), no user; None: plain."""
        if files is None:
            return cls(endpoint)
        return cls(endpoint, ca=files.ca.read_bytes(), cert=files.client_cert.read_bytes(),
                   key=files.client_key.read_bytes())

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The TLS channel credentials (CA, client pair); None without TLS."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert) if self.tls else None

    def channel(self) -> grpc.Channel:
        """A blocking gRPC channel to etcd, for its generated stubs (`aetcd.rpc`)."""
        creds = self.credentials()
        return (grpc.secure_channel(self.endpoint, creds) if creds is not None
                else grpc.insecure_channel(self.endpoint))

    def client(self, timeout: float, options: dict[str, Any]) -> aetcd.Client:
        """A new aetcd client (not yet connected) with this access."""
        host, port = split_endpoint(self.endpoint)
        kwargs: dict[str, Any] = dict(host=host, port=port, timeout=timeout, options=options,
                                      username=self.user or None,
                                      password=self.password or None)
        creds = self.credentials()
        return aetcd.Client(**kwargs) if creds is None else _Client(creds, **kwargs)


class _Client(aetcd.Client):
    """aetcd's client over a TLS channel (`connect` is aetcd 1.0's, the channel aside)."""

    def __init__(self, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @_handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials,
                                              options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False
