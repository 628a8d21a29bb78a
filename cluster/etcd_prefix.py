"""What every etcd user here shares: one replaceable aetcd client whose calls are bounded in
time, and `PrefixFollower`, a live view of every key under a prefix.

A follower takes a snapshot of the prefix, then watches from the snapshot's revision + 1, and
probes etcd every `probe_interval` (a hung etcd does not break a watch stream). When etcd is
unreachable it keeps what it saw (`synced` turns False) and reconnects with backoff; on
reconnect a new snapshot replaces the view, so keys deleted meanwhile are seen as gone. What
a snapshot and an event mean is the subclass's (`cluster.membership.MembershipWatcher`,
`conductor.control_store.EtcdControlStore`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import aetcd
import grpc
import structlog

from cluster.etcd_access import EtcdAccess
from cluster.resilience import Backoff

if TYPE_CHECKING:
    from typing import Self

log = structlog.get_logger(__name__)

# gRPC's default reconnect backoff grows to 120 s: keep it short so that etcd coming back is
# noticed within a second or two. (We also replace the client after any failure.)
GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
}

ETCD_ERRORS = (aetcd.ClientError, grpc.RpcError, asyncio.TimeoutError, OSError, ConnectionError)
"""What "etcd is unreachable or misbehaving" looks like through aetcd."""


async def bounded(aw: Awaitable[Any], timeout: float) -> Any:
    """`await aw` for at most `timeout` seconds (TimeoutError after).

    Not `asyncio.wait_for`: before Python 3.12 it returns the result, swallowing the caller's
    cancellation, when both happen together; a cancelled background task then runs on.
    """
    if hasattr(asyncio, "timeout"):  # Python >= 3.11
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)


async def close_client(client: aetcd.Client | None, timeout: float) -> None:
    if client is None:
        return
    try:
        await bounded(client.close(), timeout)
    except Exception as e:  # closing is best-effort
        log.debug("etcd_client_close_failed", error=repr(e))


class EtcdUser:
    """One replaceable client, calls bounded in time, one background task."""

    def __init__(self, etcd: str | EtcdAccess, prefix: str, rpc_timeout: float) -> None:
        self.access = etcd if isinstance(etcd, EtcdAccess) else EtcdAccess(etcd)
        self.endpoint = self.access.endpoint
        self.prefix = prefix
        self.rpc_timeout = rpc_timeout
        self._client: aetcd.Client | None = None
        self._task: asyncio.Task[None] | None = None

    def _conn(self) -> aetcd.Client:
        if self._client is None:
            self._client = self.access.client(self.rpc_timeout, dict(GRPC_OPTIONS))
        return self._client

    async def _call(self, coro: Awaitable[Any]) -> Any:
        # gRPC's own deadline (rpc_timeout) normally fires first; this is the backstop.
        return await bounded(coro, self.rpc_timeout + 0.5)

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        await close_client(client, self.rpc_timeout)

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        while not task.done():  # insist: a cancellation can be swallowed (see `bounded`)
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(task.exception()))


class PrefixFollower(EtcdUser):
    """Follows every key under `prefix` (see the module). Subclasses implement `_snapshot`
    and `_event`; both run in the follower's task and should be quick."""

    what = "prefix"
    """Names its log events: `<what>_synced`, `<what>_retry`, `<what>_watch_error`."""

    def __init__(self, etcd: str | EtcdAccess, prefix: str, *, rpc_timeout: float = 2.0,
                 probe_interval: float = 2.0, max_backoff: float = 1.0) -> None:
        super().__init__(etcd, prefix, rpc_timeout)
        self._prefix_bytes = prefix.encode()
        self._probe_interval = probe_interval
        self._max_backoff = max_backoff
        self._revision = 0
        self._synced = False
        self._first_sync = asyncio.Event()

    @property
    def synced(self) -> bool:
        """True while following etcd live; False before the first snapshot and during outages."""
        return self._synced

    @property
    def revision(self) -> int:
        """The etcd revision the view reflects."""
        return self._revision

    async def _snapshot(self, kvs: Sequence[Any], revision: int) -> None:
        """The whole prefix at `revision` (aetcd key-values: `.key`, `.value`,
        `.mod_revision`): it replaces what was seen before."""
        raise NotImplementedError

    async def _event(self, put: bool, key: bytes, value: bytes, revision: int) -> None:
        """A key was put (`put`) or deleted at `revision`."""
        raise NotImplementedError

    def _outage_fields(self) -> dict[str, Any]:
        """What the `etcd_unreachable` line says is kept."""
        return {}

    def _synced_fields(self) -> dict[str, Any]:
        return {}

    async def start(self, timeout: float | None = 10.0) -> None:
        """Start following. Waits up to `timeout` for the first snapshot (raising TimeoutError
        and closing if there is none); `None` does not wait."""
        if self._task is not None:
            raise RuntimeError(f"{self.what} follower already started")
        self._task = asyncio.create_task(self._run(), name=f"etcd-{self.what}:{self.prefix}")
        if timeout is None:
            return
        try:
            await bounded(self._first_sync.wait(), timeout)
        except TimeoutError:
            await self.close()
            raise TimeoutError(
                f"no {self.what} snapshot from etcd {self.endpoint} within {timeout}s"
            ) from None

    async def close(self) -> None:
        """Stop following (what was seen stays readable)."""
        await self._cancel_task()
        self._synced = False
        await self._drop_client()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self) -> None:
        backoff = Backoff(0.1, self._max_backoff)
        while True:
            try:
                await self._follow(backoff)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._synced:
                    log.warning("etcd_unreachable", prefix=self.prefix, error=repr(e),
                                **self._outage_fields())
                elif not isinstance(e, ETCD_ERRORS):
                    log.exception(f"{self.what}_watch_error", prefix=self.prefix)
                else:
                    log.debug(f"{self.what}_retry", prefix=self.prefix, error=repr(e))
            finally:
                self._synced = False
                await self._drop_client()
            await asyncio.sleep(backoff.next())

    async def _follow(self, backoff: Backoff) -> None:
        """One connection's life: snapshot, watch, probe; returns only by raising."""
        client = self._conn()
        snapshot = await self._call(client.get_prefix(self._prefix_bytes))
        self._revision = snapshot.header.revision
        await self._snapshot(list(snapshot), self._revision)
        watch = await self._call(
            client.watch_prefix(self._prefix_bytes, start_revision=self._revision + 1)
        )
        self._synced = True
        self._first_sync.set()
        backoff.reset()
        log.info(f"{self.what}_synced", prefix=self.prefix, revision=self._revision,
                 **self._synced_fields())
        consumer = asyncio.create_task(self._consume(watch))
        try:
            while True:
                done, _ = await asyncio.wait({consumer}, timeout=self._probe_interval)
                if done:
                    consumer.result()  # re-raises the stream's error
                    raise ConnectionError("etcd watch stream ended")
                await self._call(client.get(self._prefix_bytes))
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)

    async def _consume(self, watch: aetcd.Watch) -> None:
        async for event in watch:
            self._revision = max(self._revision, event.kv.mod_revision)
            await self._event(event.kind == aetcd.EventKind.PUT, event.kv.key, event.kv.value,
                              event.kv.mod_revision)
