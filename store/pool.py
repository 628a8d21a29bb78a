"""The KV pool behind one small protocol: a Mooncake Store client, or an in-memory fake.

Keys are `str`, values bytes-like. Mooncake's integer return codes are turned into `Outcome`s
here and nowhere else (`classify`, `MOONCAKE_CODES`); callers see booleans, `None` for a miss,
`PutReport` counts, and `PoolError`/`PoolUnavailable`/`PoolFull` where they want exceptions.

Mooncake facts this module leans on (mooncake-transfer-engine 0.3.13.post1, measured):
- `get`/`get_batch` return `b""` for a missing key, a dead master, AND for a present key that did
  not fit in the client's local buffer at that moment: empty bytes are never data.
- `put` of an existing key returns 0 and keeps the old value; `put` of `b""` returns -600.
- `put` of a memoryview with itemsize > 1 stores `len(view)` BYTES (truncates): values are cast to
  bytes-format views here before they reach Mooncake.
- `put`/`get` and their batches stage through the client's local buffer: a batch larger than
  what is free fails as a whole (put: -600) or per key (get: `b""`), also when concurrent calls
  fill it. So batches are chunked (a quarter of the buffer) and gated (`_StagingGate`).
- `get_batch([])` returns `[b""]`.
- Against a dead master a call takes ~4.3 s (returning -900 / `b""`) until the client's ping
  thread marks it unreachable (`health_check() == 2`, within 0.02-1 s of the death); against a
  hung (SIGSTOPped) master a call blocks 30 s (-901). These calls release the GIL, so they run
  here in a small thread pool under a deadline (`op_timeout_s`) behind a circuit breaker.
- Zero-copy (`ZeroCopyPool`): `batch_put_from_multi_buffers`/`batch_get_into_multi_buffers` move
  an object between registered memory (`register_buffer`) and the pool with no staging copy and
  answer per key: bytes read, 0 for a put (also of a key already there), -704 for a missing key,
  -600 when the object is larger than the ranges, -800 when smaller, -200 when the pool is full.
  Memory that was not registered fails a put (-200 here, not an error of its own).
- `setup()` and `close()` hold the GIL: `close()` for ~2 s even when healthy, `setup()` for 30 s
  against a hung master. Neither can be timed out from Python.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import logging
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from cluster.ports import free_port

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger(__name__)

Value = bytes | bytearray | memoryview
T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Outcomes: the one place Mooncake's return codes are interpreted.


class Outcome(enum.Enum):
    OK = "ok"
    MISS = "miss"  # OBJECT_NOT_FOUND and friends: not an error, just not there
    POOL_FULL = "pool_full"  # NO_AVAILABLE_HANDLE: no space left (after eviction, if any)
    UNAVAILABLE = "unavailable"  # master unreachable / timed out / not serving
    OTHER = "other"


# ErrorCode values from mooncake-store/include/types.h (kvcache-ai/Mooncake) as of v0.3.12-0.3.13;
# -901 and -1700 per vLLM's Mooncake connector, which pins them to v0.3.12. Checked against the
# codes this binary returns: -200 (full), -600 (empty value, local buffer exhausted), -704
# (missing), -706 (remove under lease), -900 (dead master), -901 (hung master, after 30 s).
MOONCAKE_CODES: dict[int, tuple[str, Outcome]] = {
    0: ("OK", Outcome.OK),
    -1: ("INTERNAL_ERROR", Outcome.OTHER),
    -10: ("BUFFER_OVERFLOW", Outcome.OTHER),
    -100: ("SHARD_INDEX_OUT_OF_RANGE", Outcome.OTHER),
    -101: ("SEGMENT_NOT_FOUND", Outcome.POOL_FULL),
    -102: ("SEGMENT_ALREADY_EXISTS", Outcome.OTHER),
    -103: ("CLIENT_NOT_FOUND", Outcome.UNAVAILABLE),  # master restarted, client not remounted yet
    -200: ("NO_AVAILABLE_HANDLE", Outcome.POOL_FULL),
    -300: ("INVALID_VERSION", Outcome.OTHER),
    -400: ("INVALID_KEY", Outcome.OTHER),
    -500: ("WRITE_FAIL", Outcome.OTHER),
    -600: ("INVALID_PARAMS", Outcome.OTHER),
    -601: ("ILLEGAL_CLIENT", Outcome.OTHER),
    -700: ("INVALID_WRITE", Outcome.OTHER),
    -701: ("INVALID_READ", Outcome.OTHER),
    -702: ("INVALID_REPLICA", Outcome.OTHER),
    -703: ("REPLICA_IS_NOT_READY", Outcome.MISS),  # still being written
    -704: ("OBJECT_NOT_FOUND", Outcome.MISS),
    -705: ("OBJECT_ALREADY_EXISTS", Outcome.OK),  # for a put: the key is in the pool
    -706: ("OBJECT_HAS_LEASE", Outcome.OTHER),
    -707: ("LEASE_EXPIRED", Outcome.MISS),  # a read outlived its lease: data not trusted
    -708: ("OBJECT_HAS_REPLICATION_TASK", Outcome.OTHER),
    -710: ("REPLICA_NOT_FOUND", Outcome.MISS),
    -712: ("REPLICA_IS_GONE", Outcome.MISS),
    -800: ("TRANSFER_FAIL", Outcome.OTHER),
    -900: ("RPC_FAIL", Outcome.UNAVAILABLE),
    -901: ("RPC_TIMEOUT", Outcome.UNAVAILABLE),
    -1010: ("UNAVAILABLE_IN_CURRENT_STATUS", Outcome.UNAVAILABLE),
    -1011: ("UNAVAILABLE_IN_CURRENT_MODE", Outcome.UNAVAILABLE),
    -1700: ("TENANT_QUOTA_EXCEEDED", Outcome.POOL_FULL),
}


def classify(code: int) -> Outcome:
    """Outcome of a Mooncake return code: >= 0 is OK (a size or success), negatives per table."""
    if code >= 0:
        return Outcome.OK
    entry = MOONCAKE_CODES.get(code)
    return entry[1] if entry else Outcome.OTHER


def code_name(code: int) -> str:
    entry = MOONCAKE_CODES.get(code)
    return entry[0] if entry else ("OK" if code >= 0 else f"UNKNOWN({code})")


class PoolError(Exception):
    """A KV pool operation failed."""


class PoolUnavailable(PoolError):
    """The pool's master cannot be reached (down, hung, or the client could not be set up)."""


class PoolFull(PoolError):
    """The pool has no space for the value (after whatever eviction the master does)."""


@dataclass(frozen=True)
class PutReport:
    """What happened to each item of one `put_many`. A key already in the pool counts as written.
    `outcomes` is aligned with the items (OK, POOL_FULL, UNAVAILABLE or OTHER)."""

    written: int = 0
    full: int = 0
    failed: int = 0
    unavailable: int = 0
    outcomes: tuple[Outcome, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, outcomes: Iterable[Outcome]) -> PutReport:
        out = tuple(Outcome.OTHER if o is Outcome.MISS else o for o in outcomes)
        return cls(
            written=sum(o is Outcome.OK for o in out),
            full=sum(o is Outcome.POOL_FULL for o in out),
            failed=sum(o is Outcome.OTHER for o in out),
            unavailable=sum(o is Outcome.UNAVAILABLE for o in out),
            outcomes=out,
        )

    @property
    def total(self) -> int:
        return self.written + self.full + self.failed + self.unavailable

    @property
    def ok(self) -> bool:
        return self.written == self.total

    def raise_for_status(self) -> None:
        """Raise `PoolUnavailable`, `PoolFull` or `PoolError` (in that order) unless all written."""
        if self.unavailable:
            raise PoolUnavailable(f"{self.unavailable}/{self.total} puts: pool unavailable")
        if self.full:
            raise PoolFull(f"{self.full}/{self.total} puts: pool full")
        if self.failed:
            raise PoolError(f"{self.failed}/{self.total} puts failed")


# ---------------------------------------------------------------------------------------------
# The protocol.


@runtime_checkable
class KVPool(Protocol):
    """A shared key -> bytes pool. Reads never return partial or empty data: `None` is a miss."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is in the pool now (False when unreachable)."""
        ...

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        """Write all items; never raises for pool-full or unavailable (see the report)."""
        ...

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        """Per key, its bytes or None (missing, unreachable, or not `expected_size` long)."""
        ...

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        """Remove keys; returns how many were removed. Without `force`, objects under a read
        lease (recent exists/get) stay."""
        ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


Fences = list[Future]
"""Calls given up on that may still touch the caller's memory (`ZeroCopyPool.get_into`)."""

Ranges = Sequence[tuple[int, int]]
"""Where one object lives in this process's memory: (address, nbytes) pieces, concatenated in
order. The memory must be registered (`register_memory`) and stay valid during the call."""


@runtime_checkable
class ZeroCopyPool(KVPool, Protocol):
    """A pool that moves objects straight between registered memory and the pool, without
    staging copies: each object is the concatenation of its `Ranges`."""

    def register_memory(self, addr: int, nbytes: int) -> None:
        """Make [addr, addr+nbytes) usable by `put_from`/`get_into`; `PoolError` on failure."""
        ...

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        """Write each key from its ranges; never raises for pool-full or unavailable.
        `segment`: place the objects in that segment (a name `segment_of` returned) while it
        has room, instead of the pool's default placement. `fences`: see `get_into`."""
        ...

    def segment_of(self, key: str) -> str | None:
        """The segment holding `key` (its first in-memory copy); None when missing or the pool
        cannot be asked."""
        ...

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        """Read each key into its ranges: True where the whole object, of exactly the ranges'
        total size, arrived. False (missing, wrong size, unreachable) leaves that key's ranges
        in an unspecified state: the caller must not use them.

        A call the pool stopped waiting for (its timeout) may still run and read or write
        the ranges later: it is appended to `fences`, and the ranges must not be freed or
        reused for anything else until it is `done()`."""
        ...


def _as_byte_view(value: Value) -> memoryview:
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("pool values must be C-contiguous buffers")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_items(items: Sequence[tuple[str, Value]]) -> tuple[list[str], list[memoryview]]:
    keys: list[str] = []
    views: list[memoryview] = []
    for key, value in items:
        if not isinstance(key, str) or not key:
            raise ValueError(f"pool keys must be non-empty str, got {key!r}")
        view = _as_byte_view(value)
        if view.nbytes == 0:
            raise ValueError(f"empty value for key {key!r}: the pool cannot store (or return) b''")
        keys.append(key)
        views.append(view)
    return keys, views


_ZC_CHUNK_BYTES = 64 << 20


def _split_ranges(
    keys: Sequence[str], ranges: Sequence[Ranges]
) -> tuple[list[str], list[list[int]], list[list[int]]]:
    if len(keys) != len(ranges):
        raise ValueError(f"{len(keys)} keys but {len(ranges)} range lists")
    ptrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for key, rs in zip(keys, ranges, strict=True):
        if not isinstance(key, str) or not key:
            raise ValueError(f"pool keys must be non-empty str, got {key!r}")
        if not rs or any(n <= 0 for _, n in rs):
            raise ValueError(f"ranges of {key!r} must be non-empty with positive sizes")
        ptrs.append([a for a, _ in rs])
        sizes.append([n for _, n in rs])
    return list(keys), ptrs, sizes


# ---------------------------------------------------------------------------------------------
# Configuration.

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


def _split_host_port(addr: str) -> tuple[str, int]:
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
        _split_host_port(self.master_addr)
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
            _split_host_port(self.store_client)
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


# ---------------------------------------------------------------------------------------------
# The real pool.


class _Down(Exception):
    """Internal: the master is (or was just) unreachable; the caller returns misses."""


# Pools whose client was abandoned while their master was unreachable: its `close()`/destructor
# would block 10-15 s holding the GIL (it retries unmounting), so it is kept alive until process
# exit, where Mooncake's own atexit handler tears it down anyway (+~6 s at exit if the master is
# dead, over a minute if it is hung). It keeps its segment memory and keeps heartbeating.
_ABANDONED: list[MooncakePool] = []
_LIVE: weakref.WeakSet[MooncakePool] = weakref.WeakSet()
_EXIT_DRAIN_S = 5.0


@atexit.register
def _drain_calls_at_exit() -> None:
    """Mooncake's atexit teardown aborts the process (SIGSEGV / std::terminate) if a store call
    is still running in one of our threads then. Such a call (say, against a master that just
    died) usually returns within ~4.3 s: wait for it, a bounded time."""
    deadline = time.monotonic() + _EXIT_DRAIN_S
    for pool in [*_ABANDONED, *_LIVE]:
        while pool._running and time.monotonic() < deadline:
            time.sleep(0.05)


_BREAKER_COOLDOWN_S = 2.0
_SLOW_MISS_S = 1.0


def _probe_master(config: PoolConfig) -> None:
    """Raise `PoolUnavailable` unless the master's RPC port accepts connections and, for an HTTP
    metadata server, it answers at all (404 is an answer). The HTTP probe also catches a hung
    master whose kernel still accepts connections, against which `setup` would block 30 s."""
    host, port = _split_host_port(config.master_addr)
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


_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class _Workers:
    """A few daemon threads running store calls. Unlike `ThreadPoolExecutor` workers they are
    not joined at interpreter exit, where a call stuck on a hung master would hold exit 30 s."""

    def __init__(self, n: int, name: str) -> None:
        self._n = n
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._queue.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        """Let the threads end once the queue drains (a stuck call ends its thread later)."""
        for _ in range(self._n):
            self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)


class _StagingGate:
    """Bytes of the client's local buffer promised to calls in flight. `put_batch`/`get_batch`
    allocate from that one buffer and fail (-600 / `b""`) when concurrent calls exhaust it, so
    each call first reserves what it will stage and releases it when it actually returns."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._cond = threading.Condition()

    def reserve(self, nbytes: int, timeout: float) -> int | None:
        """The bytes reserved (capped at capacity: an oversized call waits to run alone), or None
        on timeout."""
        nbytes = min(nbytes, self.capacity)
        with self._cond:
            fits = self._cond.wait_for(
                lambda: self._used + nbytes <= self.capacity, max(0.0, timeout)
            )
            if not fits:
                return None
            self._used += nbytes
            return nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()


class _Budget:
    """How long one pool method may still wait on Mooncake; renewed by every sign of progress."""

    __slots__ = ("timeout", "until")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.until = time.monotonic() + timeout

    def progress(self) -> None:
        self.until = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.until - time.monotonic()


class MooncakePool:
    """A Mooncake Store client (`MooncakeDistributedStore`) as a `KVPool`.

    Construction probes the master first (`_probe_master`: a dead master would otherwise make
    `setup` block ~4.4 s and fail with -600, a hung one 30 s), then runs `setup` with a fresh
    free port for `local_hostname` (reusing one within the master's `client_ttl` fails with
    -600); any failure raises `PoolUnavailable`. A master that dies between probe and setup
    still costs the ~4.4 s.

    Later calls run on a small thread pool; a method stops waiting after `op_timeout_s` without
    progress and returns misses / `unavailable` (the abandoned call finishes in the background).
    A failed or timed-out call opens a breaker for 2 s, and while the client's own ping says the
    master is unreachable no call is made at all. When the master comes back at the same
    address the client reconnects and remounts its segment by itself within ~2 s; the objects
    are gone (they lived in the master's metadata).
    """

    def __init__(self, config: PoolConfig, *, io_threads: int = 4) -> None:
        from mooncake.store import MooncakeDistributedStore  # heavy import, only when used

        self.config = config
        self._closed = False
        self._open_until = 0.0
        self._lock = threading.Lock()
        self._running: set[object] = set()  # one token per call submitted and not finished
        self._hung: set[object] = set()  # those whose caller stopped waiting
        # Chunks of a quarter of the local buffer, at most three quarters of it in flight.
        self._chunk_bytes = max(1, config.local_buffer_bytes // 4)
        self._gate = _StagingGate(config.local_buffer_bytes * 3 // 4)

        _probe_master(config)
        _LIVE.add(self)
        self._store = MooncakeDistributedStore()
        self._workers = _Workers(io_threads, "kvpool-io")
        from mooncake.store import ReplicateConfig

        self._put_config = ReplicateConfig()
        if config.store_client:
            self.local_hostname = config.store_client_segment  # the local segment
            if config.prefer_local_segment and config.store_client_segment:
                self._put_config.preferred_segment = config.store_client_segment
            code = self._store.setup_dummy(0, config.local_buffer_bytes, config.store_client)
        else:
            self.local_hostname = f"{config.local_host}:{free_port(config.local_host)}"
            if config.prefer_local_segment and config.segment_bytes > 0:
                self._put_config.preferred_segment = self.local_hostname
            code = self._store.setup(  # holds the GIL: no point in a thread with a timeout
                self.local_hostname,
                config.metadata_url,
                config.segment_bytes,
                config.local_buffer_bytes,
                config.protocol,
                config.rdma_devices,
                config.master_addr,
            )
        if code == 0 and config.store_client:
            # A dummy client reports itself healthy only after its first ping (a thread).
            deadline = time.monotonic() + config.probe_timeout_s
            while self._store.health_check() != 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        if code != 0:
            self._closed = True
            self._workers.shutdown()
            self._store.close()  # instant after a failed setup: nothing was mounted
            raise PoolUnavailable(
                f"Mooncake setup against {config.master_addr} / {config.metadata_url} as "
                f"{self.local_hostname} failed: {code} ({code_name(code)})"
            )

    # -- plumbing -------------------------------------------------------------------------------

    def _abandon(self) -> None:
        self._closed = True
        _ABANDONED.append(self)
        # Keep the client past interpreter teardown too, where module globals are cleared.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))
        self._workers.shutdown()

    def _trip(self, why: str) -> None:
        with self._lock:
            if time.monotonic() >= self._open_until:
                log.warning("KV pool %s unavailable: %s", self.config.master_addr, why)
            self._open_until = time.monotonic() + _BREAKER_COOLDOWN_S

    def _reachable(self) -> bool:
        return (
            time.monotonic() >= self._open_until
            and not self._hung
            and self._store.health_check() == 0
        )

    def _run(self, token: object, staged: int, fn: Callable[..., T], *args: Any) -> T:
        """In an I/O thread: the call, accounted before its result is visible to the caller."""
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._running.discard(token)
                self._hung.discard(token)
            if staged:
                self._gate.release(staged)

    def _budget_start(self) -> _Budget:
        if self._closed:
            raise PoolError("the KV pool is closed")
        return _Budget(self.config.op_timeout_s)

    def _call(self, budget: _Budget, fn: Callable[..., T], *args: Any, staged: int = 0,
              fences: Fences | None = None) -> T:
        """One store call staging `staged` bytes through the local buffer, or `_Down` if the
        master is known unreachable or the budget ran out (a call still running then goes to
        `fences`)."""
        if self._closed:
            raise PoolError("the KV pool is closed")
        if not self._reachable():
            raise _Down
        reserved = self._gate.reserve(staged, budget.remaining()) if staged else 0
        remaining = budget.remaining()
        if reserved is not None and remaining > 0:
            token = object()
            with self._lock:
                if self._closed:
                    self._gate.release(reserved)
                    raise PoolError("the KV pool is closed")
                self._running.add(token)
            fut = self._workers.submit(self._run, token, reserved, fn, *args)
            try:
                return fut.result(timeout=remaining)
            except FutureTimeout:
                with self._lock:
                    if fut.cancel():  # never started
                        self._running.discard(token)
                        self._gate.release(reserved)
                    elif token in self._running:
                        self._hung.add(token)  # keeps the breaker open until it returns
                        if fences is not None:
                            fences.append(fut)
        elif reserved:
            self._gate.release(reserved)
        self._trip(f"no progress for {self.config.op_timeout_s}s (in {fn.__name__})")
        raise _Down

    def _chunks(self, sizes: Sequence[int]) -> Iterable[tuple[int, int]]:
        """[start, end) runs whose total size fits a chunk (a bigger item alone)."""
        start, acc = 0, 0
        for i, size in enumerate(sizes):
            if i > start and acc + size > self._chunk_bytes:
                yield start, i
                start, acc = i, 0
            acc += size
        if start < len(sizes):
            yield start, len(sizes)

    # -- KVPool ---------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = list(keys)
        budget = self._budget_start()
        if not keys:
            return []
        try:
            codes = self._call(budget, self._store.batch_is_exist, keys)
        except _Down:
            return [False] * len(keys)
        bad = [c for c in codes if c < 0]
        if bad and any(classify(c) is Outcome.UNAVAILABLE for c in bad):
            self._trip(f"batch_is_exist: {code_name(bad[0])}")
        return [c == 1 for c in codes]

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        budget = self._budget_start()
        keys, views = _check_items(items)
        outcomes = [Outcome.UNAVAILABLE] * len(keys)
        try:
            sizes = [v.nbytes for v in views]
            for start, end in self._chunks(sizes):
                code = self._call(
                    budget,
                    self._store.put_batch,
                    keys[start:end],
                    views[start:end],
                    staged=sum(sizes[start:end]),
                )
                outcome = classify(code)
                if outcome is not Outcome.UNAVAILABLE:
                    budget.progress()
                if outcome is Outcome.OK:
                    outcomes[start:end] = [Outcome.OK] * (end - start)
                    continue
                if outcome is Outcome.UNAVAILABLE:
                    self._trip(f"put_batch: {code_name(code)}")
                    break
                if end - start == 1:
                    outcomes[start] = outcome
                    continue
                # The batch failed as a whole (full, or the local buffer was busy): find out per
                # key. Keys of the batch that did get written return 0 again.
                for i in range(start, end):
                    code = self._call(budget, self._store.put, keys[i], views[i], staged=sizes[i])
                    outcomes[i] = classify(code)
                    if outcomes[i] is Outcome.UNAVAILABLE:
                        self._trip(f"put: {code_name(code)}")
                        raise _Down
                    budget.progress()
        except _Down:
            pass
        return PutReport.of(outcomes)

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        keys = list(keys)
        budget = self._budget_start()
        out: list[bytes | None] = [None] * len(keys)
        if not keys:
            return out
        if expected_size is not None and expected_size <= 0:
            raise ValueError(f"expected_size must be > 0, got {expected_size}")
        per_item = expected_size if expected_size is not None else self._chunk_bytes // 32
        try:
            for start, end in self._chunks([per_item] * len(keys)):
                t0 = time.monotonic()
                values = self._call(
                    budget,
                    self._store.get_batch,
                    keys[start:end],
                    staged=per_item * (end - start),
                )
                for i, value in enumerate(values, start):
                    out[i] = self._accept(keys[i], value, expected_size)
                self._check_read(budget, out[start:end], t0)
                if expected_size is None and end - start > 1:
                    # Sizes unknown: an empty answer may be a key that did not fit the batch.
                    for i in range(start, end):
                        if out[i] is None:
                            t0 = time.monotonic()
                            value = self._call(
                                budget, self._store.get, keys[i], staged=self._chunk_bytes
                            )
                            out[i] = self._accept(keys[i], value, None)
                            self._check_read(budget, out[i : i + 1], t0)
        except _Down:
            pass
        return out

    def _check_read(self, budget: _Budget, got: list[bytes | None], t0: float) -> None:
        """Data is progress. Nothing back after a long wait is how a dead master looks to a get
        (b"" after ~4.3 s, while a real miss takes well under a millisecond): stop there."""
        if any(v is not None for v in got):
            budget.progress()
        elif time.monotonic() - t0 > _SLOW_MISS_S:
            self._trip(f"reads came back empty after {time.monotonic() - t0:.1f}s")
            raise _Down

    @staticmethod
    def _accept(key: str, value: bytes, expected_size: int | None) -> bytes | None:
        if not value:
            return None
        if expected_size is not None and len(value) != expected_size:
            log.warning(
                "KV pool: %r has %d bytes, expected %d; treated as a miss",
                key,
                len(value),
                expected_size,
            )
            return None
        return value

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        keys = list(keys)
        budget = self._budget_start()
        if not keys:
            return 0
        try:
            codes = self._call(budget, self._store.batch_remove, keys, force)
        except _Down:
            return 0
        if any(classify(c) is Outcome.UNAVAILABLE for c in codes):
            self._trip("batch_remove: unavailable")
        return sum(c == 0 for c in codes)

    # -- ZeroCopyPool ---------------------------------------------------------------------------

    def alloc_shared(self, nbytes: int) -> int:
        """Dummy-client pools only: `nbytes` of zeroed shared memory (memfd) the standalone
        client maps; `register_memory` accepts exactly such an allocation (whole). Lives until
        `close()`."""
        if not self.config.store_client:
            raise PoolError("alloc_shared needs store_client (a Mooncake dummy client)")
        addr = self._store.alloc_from_mem_pool(nbytes)
        if not addr:
            raise PoolError(f"alloc_from_mem_pool({nbytes}) failed")
        return addr

    def register_memory(self, addr: int, nbytes: int) -> None:
        budget = self._budget_start()
        try:
            code = self._call(budget, self._store.register_buffer, addr, nbytes)
        except _Down as e:
            raise PoolUnavailable(f"register_buffer: {self.config.master_addr} unreachable") from e
        if code != 0:
            raise PoolError(f"register_buffer({addr:#x}, {nbytes}) failed: {code_name(code)}")

    def _zero_copy_chunks(self, ranges: Sequence[Ranges]) -> Iterable[tuple[int, int]]:
        """Batches of at most `_ZC_CHUNK_BYTES` (progress is renewed per batch)."""
        start, acc = 0, 0
        for i, rs in enumerate(ranges):
            size = sum(n for _, n in rs)
            if i > start and acc + size > _ZC_CHUNK_BYTES:
                yield start, i
                start, acc = i, 0
            acc += size
        if start < len(ranges):
            yield start, len(ranges)

    def _placed(self, segment: str | None) -> Any:
        """The put config placing objects in `segment` (None: the default one)."""
        if segment is None:
            return self._put_config
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.preferred_segment = segment
        return config

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        keys, ptrs, sizes = _split_ranges(keys, ranges)
        put_config = self._placed(segment)
        budget = self._budget_start()
        outcomes = [Outcome.UNAVAILABLE] * len(keys)
        try:
            for start, end in self._zero_copy_chunks(ranges):
                codes = self._call(budget, self._store.batch_put_from_multi_buffers,
                                   keys[start:end], ptrs[start:end], sizes[start:end],
                                   put_config, fences=fences)
                got = [classify(c) for c in codes]
                outcomes[start:end] = got
                if Outcome.UNAVAILABLE in got:
                    bad = next(c for c in codes if classify(c) is Outcome.UNAVAILABLE)
                    self._trip(f"batch_put_from_multi_buffers: {code_name(bad)}")
                    break
                budget.progress()
        except _Down:
            pass
        return PutReport.of(outcomes)

    def segment_of(self, key: str) -> str | None:
        """From the master's replica descriptors: the transport endpoint of the first memory
        replica, which is the name of the segment holding it. A dummy client (`store_client`)
        cannot ask (its real client does not serve that RPC) and needs not: everything it
        writes goes to the store client's segment, which outlives the engine."""
        if self.config.store_client:
            return self.config.store_client_segment if self.exists([key])[0] else None
        budget = self._budget_start()
        try:
            replicas = self._call(budget, self._store.get_replica_desc, key)
        except _Down:
            return None
        for replica in replicas:
            if replica.is_memory_replica():
                return replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
        return None

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        keys, ptrs, sizes = _split_ranges(keys, ranges)
        budget = self._budget_start()
        out = [False] * len(keys)
        try:
            for start, end in self._zero_copy_chunks(ranges):
                t0 = time.monotonic()
                codes = self._call(budget, self._store.batch_get_into_multi_buffers,
                                   keys[start:end], ptrs[start:end], sizes[start:end],
                                   fences=fences)
                for i, code in enumerate(codes, start):
                    want = sum(sizes[i])
                    out[i] = code == want
                    if code >= 0 and code != want:
                        log.warning("KV pool: %r read %d bytes, expected %d; treated as a miss",
                                    keys[i], code, want)
                if any(classify(c) is Outcome.UNAVAILABLE for c in codes):
                    self._trip("batch_get_into_multi_buffers: unavailable")
                    raise _Down
                self._check_read(budget, [b"" if ok else None for ok in out[start:end]], t0)
        except _Down:
            pass
        return out

    def healthy(self) -> bool:
        return not self._closed and self._reachable()

    def close(self) -> None:
        """Unmount and release. Mooncake's `close()` holds the GIL ~2 s even when healthy; with
        the master dead it takes 10-15 s, with it hung 30 s+, and with a call still in flight
        it crashed the process (SIGSEGV). So unless the master answers and no call is running,
        the client is abandoned instead: kept alive (and heartbeating) until process exit.
        Waits for calls in flight (up to `op_timeout_s`), and takes up to `probe_timeout_s` +
        2.5 s more when the master is in trouble."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new calls from here on
        deadline = time.monotonic() + self.config.op_timeout_s
        while self._running and not self._hung and time.monotonic() < deadline:
            time.sleep(0.02)  # let calls in flight finish
        if self._running:
            why = "calls in flight"
        elif not self._answers():
            why = "master not answering"
        else:
            # The client's view lags (its ping) and the breaker may still be open: give it a
            # moment before deciding that a master which answers is unreachable.
            deadline = time.monotonic() + _BREAKER_COOLDOWN_S + 0.5
            while not self._reachable() and time.monotonic() < deadline:
                time.sleep(0.05)
            why = "" if self._reachable() else "master unreachable from this client"
        if why:
            log.warning(
                "KV pool %s: %s at close; abandoning the client", self.config.master_addr, why
            )
            self._abandon()
            return
        self._workers.shutdown()
        self._store.close()

    def _answers(self) -> bool:
        try:
            _probe_master(self.config)
        except PoolUnavailable:
            return False
        return True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# The fake.


class InMemoryPool:
    """A thread-safe dict as a `KVPool`, for unit tests.

    `capacity_bytes` makes writes beyond it `full` (no eviction, so tests are deterministic).
    Knobs: `fail_puts = True` makes every write `full`; `down = True` emulates a dead master
    (exists all False, gets miss, writes `unavailable`, removes nothing, not healthy);
    `late` (an Event) makes `get_into`/`put_from` calls the pool's timeout abandoned: they
    answer at once as failed (`unavailable`) and do their copies only once `late` is set,
    reported through `fences`. Read leases are not emulated: `remove` always removes.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.fail_puts = False
        self.down = False
        self.late: threading.Event | None = None
        self._data: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the KV pool is closed")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [False if self.down else k in self._data for k in keys]

    def put_many(self, items: Sequence[tuple[str, Value]]) -> PutReport:
        self._check_open()
        keys, views = _check_items(items)
        outcomes: list[Outcome] = []
        with self._lock:
            for key, view in zip(keys, views, strict=True):
                if self.down:
                    outcomes.append(Outcome.UNAVAILABLE)
                elif key in self._data:
                    outcomes.append(Outcome.OK)  # first write wins, as in Mooncake
                elif self.fail_puts or (
                    self.capacity_bytes is not None
                    and self._used + view.nbytes > self.capacity_bytes
                ):
                    outcomes.append(Outcome.POOL_FULL)
                else:
                    self._data[key] = view.tobytes()
                    self._used += view.nbytes
                    outcomes.append(Outcome.OK)
        return PutReport.of(outcomes)

    def get_many(self, keys: Sequence[str], expected_size: int | None = None) -> list[bytes | None]:
        self._check_open()
        if expected_size is not None and expected_size <= 0:
            raise ValueError(f"expected_size must be > 0, got {expected_size}")
        with self._lock:
            if self.down:
                return [None] * len(keys)
            values = [self._data.get(k) for k in keys]
        return [
            None if v is None or (expected_size is not None and len(v) != expected_size) else v
            for v in values
        ]

    def remove(self, keys: Sequence[str], *, force: bool = False) -> int:
        self._check_open()
        removed = 0
        with self._lock:
            if self.down:
                return 0
            for k in keys:
                value = self._data.pop(k, None)
                if value is not None:
                    self._used -= len(value)
                    removed += 1
        return removed

    def register_memory(self, addr: int, nbytes: int) -> None:
        self._check_open()

    def put_from(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 segment: str | None = None, fences: Fences | None = None) -> PutReport:
        if self._abandoned(fences, self._put_now, keys, ranges):
            return PutReport.of([Outcome.UNAVAILABLE] * len(keys))
        return self._put_now(keys, ranges)

    def _put_now(self, keys: Sequence[str], ranges: Sequence[Ranges]) -> PutReport:
        keys, ptrs, sizes = _split_ranges(keys, ranges)
        values = [b"".join(ctypes.string_at(a, n) for a, n in zip(p, z, strict=True))
                  for p, z in zip(ptrs, sizes, strict=True)]
        return self.put_many(list(zip(keys, values, strict=True)))

    def _abandoned(self, fences: Fences | None, call: Callable[..., Any],
                   *args: Any) -> bool:
        """With `late` set up: `call` runs once it is set, as a fence; True."""
        late = self.late
        if late is None:
            return False
        fut: Future = Future()

        def run() -> None:
            late.wait()
            try:
                call(*args)
            finally:
                fut.set_result(None)

        threading.Thread(target=run, daemon=True, name="late-call").start()
        if fences is not None:
            fences.append(fut)
        return True

    def segment_of(self, key: str) -> str | None:
        """One segment, "memory", for whatever it holds."""
        return "memory" if self.exists([key])[0] else None

    def get_into(self, keys: Sequence[str], ranges: Sequence[Ranges], *,
                 fences: Fences | None = None) -> list[bool]:
        if self._abandoned(fences, self._get_now, keys, ranges):
            return [False] * len(keys)
        return self._get_now(keys, ranges)

    def _get_now(self, keys: Sequence[str], ranges: Sequence[Ranges]) -> list[bool]:
        keys, ptrs, sizes = _split_ranges(keys, ranges)
        out = []
        for key, p, z in zip(keys, ptrs, sizes, strict=True):
            (value,) = self.get_many([key], expected_size=sum(z))
            if value is not None:
                offset = 0
                for a, n in zip(p, z, strict=True):
                    ctypes.memmove(a, value[offset : offset + n], n)
                    offset += n
            out.append(value is not None)
        return out

    def healthy(self) -> bool:
        return not self._closed and not self.down

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
