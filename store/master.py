"""Launch the Mooncake Store master (`mooncake_master`) on loopback, with its HTTP metadata server.

One process serves three ports: the master RPC (`master_addr`), the transfer-engine metadata
(`metadata_url`, replacing etcd) and the admin/metrics HTTP server (`/metrics`, `/health`).
Readiness is the admin server's `/health` answering `"service_ready": true` with the RPC and
metadata ports accepting connections.

Surprise: `mooncake_master` 0.3.13 logs that the metadata server is "started on 127.0.0.1:P"
when given `--http_metadata_server_host 127.0.0.1`, but the socket is bound to 0.0.0.0:P anyway.
The RPC and metrics servers honour `--rpc_address` / `--metrics_host`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import loopback
from cluster.ports import free_ports, wait_for_port
from cluster.process import ManagedServer

if TYPE_CHECKING:
    from typing import Self

BINARY_NAME = "mooncake_master"


def find_master_binary() -> str:
    """`mooncake_master` next to the running interpreter (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / BINARY_NAME
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(BINARY_NAME)
    if found is None:
        raise FileNotFoundError(
            f"{BINARY_NAME} not found next to {sys.executable} nor on PATH; "
            "install mooncake-transfer-engine(-non-cuda)"
        )
    return found


class StoreMaster(ManagedServer):
    """A supervised `mooncake_master`. Ports left `None` are picked free at the first start and
    kept across `restart()`, so clients can keep their addresses.

    Eviction: Mooncake evicts `eviction_ratio` of the objects (approximate LRU, in a background
    thread) once usage passes `eviction_high_watermark_ratio`. `eviction_ratio=0.0` with
    `eviction_high_watermark_ratio=1.0` disables eviction, which makes a full pool deterministic.
    Objects read or probed within `kv_lease_ttl_ms` (exists/get grant a lease) are neither evicted
    nor removable without force.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        eviction_high_watermark_ratio: float | None = None,
        eviction_ratio: float | None = None,
        kv_lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | str | None = None,
        binary: str | None = None,
        ready_timeout: float = 30.0,
        allow_wildcard_binds: bool = False,
    ) -> None:
        self.host = host
        self.allow_wildcard_binds = allow_wildcard_binds
        """On a loopback `host`: start even where its metadata server cannot be kept there
        (`cluster.loopback`); else that is `LoopbackUnavailable`."""
        self._fixed_ports = (
            rpc_port is not None or http_port is not None or metrics_port is not None
        )
        ports = free_ports(3, host)
        self.rpc_port = rpc_port or ports[0]
        self.http_port = http_port or ports[1]
        self.metrics_port = metrics_port or ports[2]
        self.eviction_high_watermark_ratio = eviction_high_watermark_ratio
        self.eviction_ratio = eviction_ratio
        self.kv_lease_ttl_ms = kv_lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.extra_args = list(extra_args)
        self.binary = binary or find_master_binary()
        self.ready_timeout = ready_timeout
        if log_path is None:
            name = f"kvcluster-mooncake-master-{os.getpid()}-{self.rpc_port}.log"
            log_path = Path(tempfile.gettempdir()) / name
        self.log_path = Path(log_path)

    # -- addresses ------------------------------------------------------------------------------

    @property
    def master_addr(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def argv(self) -> list[str]:
        args = [
            self.binary,
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr=true",
        ]
        if self.eviction_high_watermark_ratio is not None:
            args.append(f"--eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}")
        if self.eviction_ratio is not None:
            args.append(f"--eviction_ratio={self.eviction_ratio}")
        if self.kv_lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}")
        if self.client_ttl_s is not None:
            args.append(f"--client_ttl={self.client_ttl_s}")
        return args + self.extra_args

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> StoreMaster:
        """Start and wait until ready. Auto-picked ports are re-picked once if the first start
        loses a race for them; fixed ports are not."""
        if self.alive():
            return self
        try:
            self._start_once()
        except RuntimeError:
            if self._fixed_ports:
                raise
            self.rpc_port, self.http_port, self.metrics_port = free_ports(3, self.host)
            self._start_once()
        return self

    def _start_once(self) -> None:
        returncode = self._launch(f"mooncake_master:{self.rpc_port}", self.argv(),
                                  self.ready_timeout,
                                  env=loopback.env(self.host,
                                                   allow_wildcard=self.allow_wildcard_binds))
        if returncode is not None:
            raise RuntimeError(f"mooncake_master exited with {returncode} before ready; "
                               f"log {self.log_path}:\n{self.tail()}")

    def ready(self, deadline: float) -> bool:
        try:
            url = f"http://{self.host}:{self.metrics_port}/health"
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if not json.loads(resp.read()).get("service_ready"):
                    return False
        except (OSError, ValueError):
            return False
        remaining = max(0.5, deadline - time.monotonic())
        return wait_for_port(self.host, self.rpc_port, remaining) and wait_for_port(
            self.host, self.http_port, remaining
        )

    def restart(self) -> StoreMaster:
        """Stop and start again on the same ports (an empty pool; clients remount by themselves).
        Stopping forgets every object in the pool."""
        self.stop()
        self._start_once()
        return self

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"StoreMaster(master_addr={self.master_addr!r}, metadata_url={self.metadata_url!r}, "
            f"metrics_port={self.metrics_port}, alive={self.alive()})"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run a master in the foreground until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m store.master", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--rpc-port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None, help="HTTP metadata server port")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--eviction-high-watermark-ratio", type=float, default=None)
    p.add_argument("--eviction-ratio", type=float, default=None)
    p.add_argument("--kv-lease-ttl-ms", type=int, default=None)
    p.add_argument("--client-ttl-s", type=int, default=None)
    p.add_argument("--log", default="run/store_master.log")
    p.add_argument(loopback.OPT_OUT, action="store_true",
                   default=os.environ.get("KVCLUSTER_ALLOW_WILDCARD_BINDS", "") == "1",
                   help="on a loopback --host, start even without the bind shim "
                   "(cluster/loopback.py): the metadata server then listens on every address")
    args, extra = p.parse_known_args(argv)
    master = StoreMaster(
        host=args.host,
        rpc_port=args.rpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
        eviction_ratio=args.eviction_ratio,
        kv_lease_ttl_ms=args.kv_lease_ttl_ms,
        client_ttl_s=args.client_ttl_s,
        extra_args=extra,
        log_path=args.log,
        allow_wildcard_binds=args.allow_wildcard_binds,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        master.start()
    except loopback.LoopbackUnavailable as e:
        print(f"store.master: {e}", file=sys.stderr, flush=True)
        return 1
    print(
        f"KVCLUSTER_POOL_MASTER_ADDR={master.master_addr}\n"
        f"KVCLUSTER_POOL_METADATA_URL={master.metadata_url}\n"
        f"# metrics {master.metrics_url}, pid {master.pid}, log {master.log_path}",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if not master.alive():
                print(f"mooncake_master died; log tail:\n{master.tail()}", flush=True)
                return 1
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())


class StoreClientService(ManagedServer):
    """A supervised standalone `mooncake_client` (Mooncake's RealClient as its own process): it
    owns `segment` of pool memory and serves the Mooncake *dummy* clients of this host
    (`PoolConfig.store_client`) over RPC on `port` and a Unix socket
    (`@mooncake_client_<port>.sock`) through which they hand it their shared memory. Put and get
    of a dummy client are then memcpys inside this process (MC_STORE_MEMCPY, auto-on when TCP is
    the only transport): two engines on one host exchange KV without TCP."""

    def __init__(self, master: StoreMaster, *, segment: str = "2GB", host: str = "127.0.0.1",
                 port: int | None = None, threads: int = 1, log_path: Path | str | None = None,
                 extra_args: Sequence[str] = (), allow_wildcard_binds: bool = False) -> None:
        self.master = master
        self.allow_wildcard_binds = allow_wildcard_binds
        """As `StoreMaster.allow_wildcard_binds`, for its transfer engine."""
        self.segment = segment
        self.host = host
        self.port, self.te_port = free_ports(2, host)
        self.port = port or self.port
        self.threads = threads
        self.extra_args = list(extra_args)
        binary = Path(find_master_binary()).parent / "mooncake_client"
        if not binary.is_file():  # the wheel keeps it inside the package
            import mooncake

            binary = Path(mooncake.__file__).parent / "mooncake_client"
        self.binary = str(binary)
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"kvcluster-mooncake-client-{self.port}.log"
        self.log_path = Path(log_path)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def segment_name(self) -> str:
        """The name of the segment it contributes (its transfer-engine host:port): what
        `PoolConfig.store_client_segment` names so that puts land in it."""
        return f"{self.host}:{self.te_port}"

    def argv(self) -> list[str]:
        return [self.binary, f"--host={self.segment_name}", f"--port={self.port}",
                f"--global_segment_size={self.segment}", "--protocol=tcp",
                f"--master_server_address={self.master.master_addr}",
                f"--metadata_server={self.master.metadata_url}", f"--threads={self.threads}",
                "--logtostderr=true", *self.extra_args]

    def start(self, timeout: float = 30.0) -> StoreClientService:
        returncode = self._launch(f"mooncake_client:{self.port}", self.argv(), timeout,
                                  env=loopback.env(self.host,
                                                   allow_wildcard=self.allow_wildcard_binds))
        if returncode is not None:
            raise RuntimeError(f"mooncake_client exited with {returncode} at start; "
                               f"log {self.log_path}:\n{self.tail()}")
        return self

    def ready(self, deadline: float) -> bool:
        return wait_for_port(self.host, self.port, 0.2)
