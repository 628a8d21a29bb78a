"""Worker membership in etcd: a worker's leased registration, and a live view of all workers.

Each worker holds `<prefix><instance_id>` -> `InstanceInfo` JSON attached to its own lease, so a
worker that dies without deregistering disappears `ttl` seconds after its last keep-alive (the
watcher sees a DELETE). Both sides ride out etcd outages: the registration retries and, once etcd
answers again, re-registers on a fresh lease; the watcher keeps serving the last membership it
saw and re-snapshots on reconnect. Every etcd call is bounded by `rpc_timeout`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from cluster.etcd_access import EtcdAccess
from cluster.etcd_prefix import ETCD_ERRORS, EtcdUser, PrefixFollower, bounded
from cluster.instance import InstanceInfo
from cluster.resilience import Backoff

if TYPE_CHECKING:
    from typing import Self

log = structlog.get_logger(__name__)

DEFAULT_PREFIX = "/kvcluster/instances/"

MembersCallback = Callable[[dict[str, InstanceInfo]], Awaitable[None] | None]


class Registration(EtcdUser):
    """Keeps `info` registered under `<prefix><instance_id>` on a lease of `ttl` seconds.

    The lease is refreshed every ttl/3. When etcd can't be reached the registration retries with
    backoff; once it can, it grants a fresh lease, re-puts the key and revokes the old lease
    best-effort (after the key has moved, so the key itself never blinks). The same happens at
    once if a refresh finds the lease expired. etcd enforces a minimum TTL (2 s by default);
    the refresh period follows the TTL etcd actually granted.

    After each refresh the key is read back: deleted, or holding another value or another
    lease (someone wrote it: their value, or ours on a lease that would outlive this worker),
    it is put back on our lease, so within a third of the TTL plus a round trip. Two live
    workers registering one instance id therefore take the key in turns, each logging
    `registration_reasserted`.
    """

    def __init__(
        self,
        etcd: str | EtcdAccess,
        info: InstanceInfo,
        *,
        ttl: int = 5,
        prefix: str = DEFAULT_PREFIX,
        rpc_timeout: float = 2.0,
        max_backoff: float = 1.0,
    ) -> None:
        super().__init__(etcd, prefix, rpc_timeout)
        self.info = info
        self.ttl = ttl
        self.key = f"{prefix}{info.instance_id}"
        self._value = info.to_json()
        self._refresh_interval = ttl / 3
        self._max_backoff = max_backoff
        self._lease_id: int | None = None
        self._pending_lease: int | None = None  # granted, not yet known to hold the key
        self._registered = False
        self._first_registration = asyncio.Event()

    @property
    def registered(self) -> bool:
        """True while the last exchange with etcd confirmed that our lease and key are live."""
        return self._registered

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    async def start(self, timeout: float | None = 10.0) -> None:
        """Register and start the keep-alive. Waits up to `timeout` for the first registration
        (raising TimeoutError and stopping if it does not happen); `None` does not wait."""
        if self._task is not None:
            raise RuntimeError(f"registration {self.key} already started")
        self._task = asyncio.create_task(self._run(), name=f"etcd-registration:{self.key}")
        if timeout is None:
            return
        try:
            await bounded(self._first_registration.wait(), timeout)
        except TimeoutError:
            await self.abandon()
            raise TimeoutError(
                f"could not register {self.key} at etcd {self.endpoint} within {timeout}s"
            ) from None

    async def stop(self, timeout: float | None = None) -> None:
        """Deregister: stop the keep-alive and revoke the lease, which deletes the key.

        Bounded by `timeout` (default: rpc_timeout); if etcd is unreachable the key is left to
        expire with its lease after ttl seconds.
        """
        await self._cancel_task()
        leases = {lease for lease in (self._lease_id, self._pending_lease) if lease is not None}
        self._lease_id = self._pending_lease = None
        self._registered = False
        if leases:
            client = self._conn()
            try:
                await bounded(
                    asyncio.gather(*(client.revoke_lease(lease) for lease in leases)),
                    self.rpc_timeout if timeout is None else timeout,
                )
                log.info("deregistered", key=self.key)
            except ETCD_ERRORS as e:
                log.warning("deregister_failed", key=self.key, error=repr(e), expires_in=self.ttl)
        await self._drop_client()

    async def close(self) -> None:
        """Same as `stop()`."""
        await self.stop()

    async def abandon(self) -> None:
        """Stop the keep-alive without revoking, as a crash would: the key expires after ttl."""
        await self._cancel_task()
        self._registered = False
        await self._drop_client()
        log.info("registration_abandoned", key=self.key, lease=self._lease_id)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        backoff = Backoff(0.1, self._max_backoff)
        while True:
            try:
                if not self._registered:
                    await self._register()
                    backoff.reset()
                await asyncio.sleep(self._refresh_interval)
                if not await self._refresh():
                    log.warning("lease_expired", key=self.key, lease=self._lease_id)
                    self._registered = False  # re-register right away
                else:
                    await self._reassert()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._registered:
                    log.warning("etcd_unreachable", key=self.key, error=repr(e), retrying=True)
                elif not isinstance(e, ETCD_ERRORS):
                    log.exception("registration_error", key=self.key)
                else:
                    log.debug("registration_retry", key=self.key, error=repr(e))
                self._registered = False
                await self._drop_client()
                await asyncio.sleep(backoff.next())

    async def _register(self) -> None:
        client = self._conn()
        lease = await self._call(client.lease(self.ttl))
        self._pending_lease = lease.id
        try:
            await self._call(client.put(self.key.encode(), self._value, lease=lease.id))
        except Exception:
            self._pending_lease = None
            await self._revoke_quietly(lease.id)  # holds no key; would expire anyway
            raise
        old, self._lease_id, self._pending_lease = self._lease_id, lease.id, None
        self._registered = True
        self._refresh_interval = max(lease.ttl, 1) / 3
        self._first_registration.set()
        log.info("registered", key=self.key, lease=lease.id, ttl=lease.ttl, replaced=old)
        if old is not None and old != lease.id:
            await self._revoke_quietly(old)  # the key moved to the new lease already

    async def _refresh(self) -> bool:
        """Keep-alive once; False if etcd says the lease no longer exists (TTL 0)."""
        assert self._lease_id is not None
        reply = await self._call(self._conn().refresh_lease(self._lease_id))
        return reply is not None and reply.TTL > 0

    async def _reassert(self) -> None:
        """Put our key back unless it holds our value on our lease."""
        client = self._conn()
        got = await self._call(client.get(self.key.encode()))
        if got is not None and got.value == self._value and got.lease == self._lease_id:
            return
        await self._call(client.put(self.key.encode(), self._value, lease=self._lease_id))
        log.warning("registration_reasserted", key=self.key, lease=self._lease_id,
                    found="nothing" if got is None
                    else "another value" if got.value != self._value else "another lease")

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._call(self._conn().revoke_lease(lease_id))
        except ETCD_ERRORS as e:
            log.debug("revoke_failed", key=self.key, lease=lease_id, error=repr(e))


class MembershipWatcher(PrefixFollower):
    """A live `instance_id -> InstanceInfo` map of everything registered under `prefix`.

    Follows etcd as `cluster.etcd_prefix.PrefixFollower` does: when etcd is unreachable the
    last membership is kept (`synced` turns False); on reconnect the snapshot replaces the map,
    so members that vanished meanwhile are removed. Malformed entries are logged and ignored.

    `on_change(members)` (sync or async) gets a copy of the map after every change; it runs in
    the watcher's task, so it should be quick. Its errors are logged, not raised.
    """

    what = "membership"

    def __init__(
        self,
        etcd: str | EtcdAccess,
        *,
        prefix: str = DEFAULT_PREFIX,
        on_change: MembersCallback | None = None,
        rpc_timeout: float = 2.0,
        probe_interval: float = 2.0,
        max_backoff: float = 1.0,
    ) -> None:
        super().__init__(etcd, prefix, rpc_timeout=rpc_timeout, probe_interval=probe_interval,
                         max_backoff=max_backoff)
        self._on_change = on_change
        self._members: dict[str, InstanceInfo] = {}
        self._changed = asyncio.Condition()

    def members(self) -> dict[str, InstanceInfo]:
        """A copy of the current membership."""
        return dict(self._members)

    def get(self, instance_id: str) -> InstanceInfo | None:
        return self._members.get(instance_id)

    async def wait_for(
        self, predicate: Callable[[dict[str, InstanceInfo]], bool], timeout: float
    ) -> bool:
        """Wait until `predicate(members)` holds; False if it still doesn't after `timeout`."""
        async with self._changed:
            try:
                await bounded(self._changed.wait_for(lambda: predicate(self.members())), timeout)
                return True
            except TimeoutError:
                return False

    def _outage_fields(self) -> dict[str, Any]:
        return {"keeping_members": len(self._members)}

    def _synced_fields(self) -> dict[str, Any]:
        return {"members": sorted(self._members)}

    async def _snapshot(self, kvs: Sequence[Any], revision: int) -> None:
        members: dict[str, InstanceInfo] = {}
        for kv in kvs:
            item = self._decode(kv.key, kv.value)
            if item is not None:
                members[item.instance_id] = item
        await self._replace(members)

    async def _event(self, put: bool, key: bytes, value: bytes, revision: int) -> None:
        instance_id = key[len(self._prefix_bytes) :].decode(errors="replace")
        item = self._decode(key, value) if put else None
        before = self._members.get(instance_id)
        if item is not None:
            self._members[instance_id] = item
        else:
            self._members.pop(instance_id, None)
        if item != before:
            self._log_change(instance_id, before, item)
            await self._notify()

    async def _replace(self, members: dict[str, InstanceInfo]) -> None:
        if members == self._members:
            return
        old, self._members = self._members, members
        for instance_id in sorted(set(old) | set(members)):
            if old.get(instance_id) != members.get(instance_id):
                self._log_change(instance_id, old.get(instance_id), members.get(instance_id))
        await self._notify()

    def _decode(self, key: bytes, value: bytes) -> InstanceInfo | None:
        instance_id = key[len(self._prefix_bytes) :].decode(errors="replace")
        try:
            info = InstanceInfo.from_json(value)
        except ValueError as e:
            log.warning("member_invalid", key=key.decode(errors="replace"), error=str(e))
            return None
        if info.instance_id != instance_id:
            log.warning(
                "member_key_mismatch",
                key=key.decode(errors="replace"),
                instance_id=info.instance_id,
            )
            return None
        return info

    def _log_change(
        self, instance_id: str, before: InstanceInfo | None, after: InstanceInfo | None
    ) -> None:
        if after is None:
            log.info("member_removed", instance_id=instance_id)
        elif before is None:
            log.info(
                "member_added", instance_id=instance_id, role=after.role, address=after.address
            )
        else:
            log.info(
                "member_updated", instance_id=instance_id, role=after.role, address=after.address
            )

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        if self._on_change is None:
            return
        try:
            result = self._on_change(self.members())
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("membership_callback_failed", prefix=self.prefix)
