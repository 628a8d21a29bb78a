"""Where the control state is kept: etcd (`EtcdControlStore`, every replica of the conductor
sharing one prefix), or this process's memory (`MemoryControlStore`: tests, and a conductor
whose membership is not etcd's).

A store hands its follower (`conductor.control_state.ControlState`) the whole prefix at once
(`on_snapshot`: at start and after every reconnect) and then each change (`on_event`), with
etcd's revisions; keys are relative to the prefix, values raw bytes. `read` and `commit` are
single etcd transactions: what `commit` writes lands whole or not at all, and only if every
key it expects is still at the revision it was read at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import aetcd

from cluster.etcd_access import EtcdAccess
from cluster.etcd_prefix import ETCD_ERRORS, EtcdUser, PrefixFollower

Snapshot = Callable[[dict[str, tuple[bytes, int]], int], None]
"""(key -> (value, mod revision), the snapshot's revision)."""
Event = Callable[[str, bytes | None, int], None]
"""(key, value or None when deleted, the change's revision)."""


class StoreUnavailable(Exception):
    """The store did not answer (etcd unreachable or refusing): nothing was written."""


class ControlStore(Protocol):
    @property
    def synced(self) -> bool:
        """Following the store live (False before the first snapshot and during outages)."""

    async def start(self, on_snapshot: Snapshot, on_event: Event,
                    timeout: float | None) -> None: ...

    async def close(self) -> None: ...

    async def read(self, keys: Sequence[str]) -> dict[str, tuple[bytes | None, int]]:
        """Each key's value (None: absent) and mod revision (0: absent), read at once."""

    async def commit(self, expect: Mapping[str, int],
                     writes: Mapping[str, bytes | None]) -> int | None:
        """Put (bytes) or delete (None) every key of `writes` at once, if every key of `expect`
        is at its revision (0: absent); the revision written, None when one was not."""


class EtcdControlStore(PrefixFollower):
    what = "control"

    def __init__(self, etcd: str | EtcdAccess, prefix: str, rpc_timeout: float = 2.0,
                 probe_interval: float = 2.0, max_backoff: float = 1.0) -> None:
        super().__init__(etcd, prefix, rpc_timeout=rpc_timeout, probe_interval=probe_interval,
                         max_backoff=max_backoff)
        self._writer = EtcdUser(self.access, prefix, rpc_timeout)
        """A client of its own: a write does not share the fate of the watch's connection."""
        self._on_snapshot: Snapshot = lambda kvs, revision: None
        self._on_event: Event = lambda key, value, revision: None

    async def start(self, on_snapshot: Snapshot, on_event: Event,  # type: ignore[override]
                    timeout: float | None = 10.0) -> None:
        self._on_snapshot, self._on_event = on_snapshot, on_event
        await super().start(timeout)

    async def close(self) -> None:
        await super().close()
        await self._writer._drop_client()

    def _key(self, raw: bytes) -> str:
        return raw[len(self._prefix_bytes):].decode(errors="replace")

    async def _snapshot(self, kvs: Sequence[Any], revision: int) -> None:
        self._on_snapshot({self._key(kv.key): (kv.value, kv.mod_revision) for kv in kvs},
                          revision)

    async def _event(self, put: bool, key: bytes, value: bytes, revision: int) -> None:
        self._on_event(self._key(key), value if put else None, revision)

    async def read(self, keys: Sequence[str]) -> dict[str, tuple[bytes | None, int]]:
        client = self._writer._conn()
        ops = client.transactions
        _, responses = await self._txn(client, [], [ops.get(self._full(k)) for k in keys])
        out: dict[str, tuple[bytes | None, int]] = {}
        for key, got in zip(keys, responses, strict=True):
            out[key] = (got[0][0], got[0][1].mod_revision) if got else (None, 0)
        return out

    async def commit(self, expect: Mapping[str, int],
                     writes: Mapping[str, bytes | None]) -> int | None:
        client = self._writer._conn()
        ops = client.transactions
        compare = [ops.mod(self._full(k)) == rev for k, rev in expect.items()]
        success = [ops.put(self._full(k), v) if v is not None else ops.delete(self._full(k))
                   for k, v in writes.items()]
        ok, responses = await self._txn(client, compare, success)
        if not ok:
            return None
        first = responses[0]
        inner = first.response_put if first.HasField("response_put") \
            else first.response_delete_range
        return int(inner.header.revision)

    def _full(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    async def _txn(self, client: aetcd.Client, compare: list, success: list) -> tuple:
        try:
            return await self._writer._call(client.transaction(compare=compare, success=success,
                                                               failure=[]))
        except ETCD_ERRORS as e:
            await self._writer._drop_client()  # the next call connects afresh
            raise StoreUnavailable(f"etcd at {self.endpoint} did not answer: {e!r}") from None


class MemoryControlStore:
    """The store in this process only: no other replica sees it, nothing outlives the process."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, int]] = {}
        self._revision = 1
        self.down = False
        """Tests: answer as an unreachable etcd would."""

    @property
    def synced(self) -> bool:
        return not self.down

    async def start(self, on_snapshot: Snapshot, on_event: Event,
                    timeout: float | None = None) -> None:
        on_snapshot(dict(self._data), self._revision)

    async def close(self) -> None:
        pass

    async def read(self, keys: Sequence[str]) -> dict[str, tuple[bytes | None, int]]:
        self._check()
        return {k: self._data.get(k, (None, 0)) for k in keys}

    async def commit(self, expect: Mapping[str, int],
                     writes: Mapping[str, bytes | None]) -> int | None:
        self._check()
        if any(self._data.get(k, (b"", 0))[1] != rev for k, rev in expect.items()):
            return None
        self._revision += 1
        for k, v in writes.items():
            if v is None:
                self._data.pop(k, None)
            else:
                self._data[k] = (v, self._revision)
        return self._revision

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("the control store is down")
