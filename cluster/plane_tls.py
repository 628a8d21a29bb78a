"""Mutual TLS on the worker plane (the conductor's gRPC calls to the workers).

A TLS directory (`tls_dir` in the conductor's and the workers' configs, the same files on
every node; `python -m cluster.certs --out DIR --host kvcluster-worker --name kvcluster-worker`
makes one, `deploy/conductor.sh` with `KVCLUSTER_WORKER_TLS=1`) holds:

    ca.pem                       the plane's CA
    server.pem, server-key.pem   the workers' certificate, for the name `kvcluster-worker`
    client.pem, client-key.pem   the conductor's

Workers then serve TLS only and take only clients whose certificate the CA signed; the
conductor takes only workers whose certificate the CA signed for that name. The name, not the
worker's address: one certificate serves every worker (addresses come and go with etcd), and
the cluster secret's proof (`cluster.secret`) still binds each worker to its address. The
secret's tokens then cross the wire encrypted, with the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grpc

from cluster.certs import CertFiles, make_certs

NAME = "kvcluster-worker"
"""The name every worker's certificate is made for, and the conductor checks."""

Side = Literal["server", "client"]


@dataclass(frozen=True)
class PlaneTLS:
    """One side's TLS material: the CA and this side's certificate and key."""

    side: Side
    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @classmethod
    def load(cls, tls_dir: str, side: Side) -> PlaneTLS | None:
        """The files a `side` needs in `tls_dir` (None for ""); ValueError names a missing
        or unreadable one."""
        if not tls_dir:
            return None
        files = CertFiles.in_dir(Path(tls_dir))
        paths = ((files.server_cert, files.server_key) if side == "server"
                 else (files.client_cert, files.client_key))
        try:
            ca, cert, key = (p.read_bytes() for p in (files.ca, *paths))
        except OSError as e:
            raise ValueError(f"worker-plane TLS ({tls_dir}): {e}") from e
        return cls(side, ca, cert, key)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A worker's: its certificate, and a client certificate from the CA required."""
        assert self.side == "server"
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The conductor's: its certificate, and the workers' checked against the CA."""
        assert self.side == "client"
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def make(tls_dir: str | Path) -> Path:
    """A new CA and pairs for the plane in `tls_dir` (an existing set is kept)."""
    return make_certs(tls_dir, [NAME], NAME).ca.parent


CHANNEL_OPTIONS: tuple[tuple[str, str], ...] = (("grpc.ssl_target_name_override", NAME),)
"""Check a worker's certificate for `NAME` rather than for the address dialled."""


def aio_channel(address: str, tls: PlaneTLS | None,
                options: tuple[tuple[str, int | str], ...] = ()) -> grpc.aio.Channel:
    """An asyncio channel to the worker at `address`: TLS when `tls` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=(*options, *CHANNEL_OPTIONS))


def channel(address: str, tls: PlaneTLS | None) -> grpc.Channel:
    """A blocking channel to the worker at `address` (tools, tests): TLS when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS)


def bind(server: grpc.aio.Server, address: str, tls: PlaneTLS | None) -> int:
    """Listen on `address` (TLS when `tls` is given); the port got (0: none)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
