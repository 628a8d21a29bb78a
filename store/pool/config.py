"""How a process joins the pool (`PoolConfig`: validated once, from arguments or
`KVCLUSTER_POOL_*`), and the probe that tells whether its master answers before `setup`."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from store.pool.outcomes import PoolUnavailable

_ENV_PREFIX = "KVCLUSTER_POOL_"
_SIZE_SUFFIXES = {
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
}
PROTOCOLS = ("tcp", "rdma")


def parse_size(text: str) -> int:
    """`"536870912"`, `"512MiB"`, `"512M"`, `"1GiB"` -> bytes (binary units)."""
    s = text.strip().lower().replace("_", "")
    for suffix, mult in sorted(_SIZE_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {addr!r}")
    return host, int(port)


@dataclass(frozen=True)
class PoolConfig:
    """How a process joins the pool. `segment_bytes` is the memory this process contributes to
    the pool (0 = a pure client); `local_buffer_bytes` is its staging buffer for put/get batches.
    A pool method gives up (misses / `unavailable`) after `op_timeout_s` without progress;
    `probe_timeout_s` bounds the reachability probe before `setup`."""

    master_addr: str
    metadata_url: str
    local_host: str = "127.0.0.1"
    segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 128 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    op_timeout_s: float = 5.0
    probe_timeout_s: float = 2.0
    store_client: str = ""
    """host:port of a standalone `mooncake_client` (Mooncake's RealClient process) on this host.
    Set: this pool is a Mooncake *dummy* client (`setup_dummy`): the standalone client owns the
    segment and the transfers, and memory given by `alloc_shared` (memfd, passed to it over a
    Unix socket) is what can be registered. Two processes on one host then move data by memcpy
    through that client (MC_STORE_MEMCPY, on by default on TCP-only hosts) instead of TCP.
    `segment_bytes` and `local_host` do not apply."""
    store_client_segment: str = ""
    """The standalone client's segment name (its `--host`, host:port): with
    `prefer_local_segment`, puts go there (otherwise Mooncake may place them in any segment,
    another process's, and the copy becomes a TCP transfer)."""
    prefer_local_segment: bool = False
    """`put_from` places objects in this process's own segment while it has room (Mooncake's
    `ReplicateConfig.preferred_segment`; it falls back to other segments when full): a writer
    then copies locally and only readers elsewhere cross the network."""

    def __post_init__(self) -> None:
        split_host_port(self.master_addr)
        url = urlsplit(self.metadata_url)
        if self.metadata_url != "P2PHANDSHAKE" and (
            url.scheme not in ("http", "https", "etcd", "redis") or not url.netloc
        ):
            raise ValueError(
                f"metadata_url must be http(s)://host:port/..., "
                f"etcd://, redis:// or P2PHANDSHAKE, got {self.metadata_url!r}"
            )
        if not self.local_host or ":" in self.local_host:
            raise ValueError(f"local_host must be a bare host, got {self.local_host!r}")
        if self.segment_bytes < 0:
            raise ValueError(f"segment_bytes must be >= 0, got {self.segment_bytes}")
        if self.local_buffer_bytes < 1 << 20:
            raise ValueError(f"local_buffer_bytes must be >= 1 MiB, got {self.local_buffer_bytes}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.protocol == "tcp" and self.rdma_devices:
            raise ValueError("rdma_devices given with protocol 'tcp'")
        if self.store_client:
            split_host_port(self.store_client)
        if not self.op_timeout_s > 0 or not self.probe_timeout_s > 0:
            raise ValueError("op_timeout_s and probe_timeout_s must be > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PoolConfig:
        """From `KVCLUSTER_POOL_{MASTER_ADDR,METADATA_URL,LOCAL_HOST,SEGMENT_BYTES,
        LOCAL_BUFFER_BYTES,PROTOCOL,RDMA_DEVICES,OP_TIMEOUT_S,PROBE_TIMEOUT_S,
        PREFER_LOCAL_SEGMENT}`; sizes accept
        KiB/MiB/GiB suffixes. Keyword overrides win over the environment."""
        env = dict(os.environ if env is None else env)
        kwargs: dict[str, Any] = {}
        conv: dict[str, Callable[[str], Any]] = {
            "master_addr": str, "metadata_url": str, "local_host": str,
            "segment_bytes": parse_size, "local_buffer_bytes": parse_size,
            "protocol": str, "rdma_devices": str,
            "op_timeout_s": float, "probe_timeout_s": float,
            "prefer_local_segment": lambda v: v.strip().lower() in ("1", "true", "yes"),
            "store_client": str, "store_client_segment": str,
        }  # fmt: skip
        for name, fn in conv.items():
            raw = env.get(_ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                kwargs[name] = fn(raw)
        kwargs.update(overrides)
        missing = [n for n in ("master_addr", "metadata_url") if n not in kwargs]
        if missing:
            names = ", ".join(_ENV_PREFIX + n.upper() for n in missing)
            raise ValueError(f"pool config incomplete: set {names}")
        return cls(**kwargs)


def probe_master(config: PoolConfig) -> None:
    """Raise `PoolUnavailable` unless the master's RPC port accepts connections and, for an HTTP
    metadata server, it answers at all (404 is an answer). The HTTP probe also catches a hung
    master whose kernel still accepts connections, against which `setup` would block 30 s."""
    host, port = split_host_port(config.master_addr)
    timeout = config.probe_timeout_s
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise PoolUnavailable(f"Mooncake master {config.master_addr} is not reachable: {e}") from e
    if urlsplit(config.metadata_url).scheme not in ("http", "https"):
        return
    sep = "&" if "?" in config.metadata_url else "?"
    try:
        urllib.request.urlopen(f"{config.metadata_url}{sep}key=kvcluster-probe", timeout=timeout)
    except urllib.error.HTTPError:
        pass  # it answered
    except (OSError, ValueError) as e:
        raise PoolUnavailable(f"metadata server {config.metadata_url} is not answering: {e}") from e
