"""Follows what the pool holds: the Mooncake master lists its keys over HTTP
(`/get_all_keys` on its metrics port); every `interval_s` the conductor reads the list, keeps
the keys of the namespaces its instances registered (`<namespace>/<block hash in hex>`),
and makes that the index's pool location. This is how the index learns the pool's
evictions (the master's ZMQ event publisher is not built into the 0.3.13 wheel) and how a
restarted conductor rebuilds its pool view. Cost: one listing and an O(indexed blocks) pass
per interval.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx
import structlog

from conductor.scheduler.index import POOL, KVIndex
from store.block_hash import HASH_BYTES

log = structlog.get_logger(__name__)


def parse_keys(text: str, namespaces: set[str]) -> set[int]:
    """The block hashes of the listed keys that belong to `namespaces`."""
    out = set()
    for line in text.splitlines():
        ns, sep, digest = line.strip().rpartition("/")
        if sep and ns in namespaces and len(digest) == 2 * HASH_BYTES:
            with contextlib.suppress(ValueError):
                out.add(int(digest, 16))
    return out


class PoolSync:
    def __init__(self, index: KVIndex, url: str, namespaces: Callable[[], set[str]],
                 interval_s: float) -> None:
        self.index = index
        self.url = url.rstrip("/") + "/get_all_keys"
        self.namespaces = namespaces
        self.interval_s = interval_s
        self.syncs = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pool-sync")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def sync_once(self, client: httpx.AsyncClient) -> tuple[int, int] | None:
        namespaces = self.namespaces()
        if not namespaces:
            return None
        r = await client.get(self.url)
        r.raise_for_status()
        added, dropped = self.index.sync(POOL, parse_keys(r.text, namespaces))
        self.syncs += 1
        if added or dropped:
            log.info("pool_synced", added=added, dropped=dropped, held=self.index.blocks(POOL))
        return added, dropped

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=max(self.interval_s, 2.0)) as client:
            while True:
                try:
                    await self.sync_once(client)
                except (httpx.HTTPError, OSError) as e:
                    self.failures += 1  # the master is down: keep the last view
                    log.warning("pool_sync_failed", error=repr(e))
                await asyncio.sleep(self.interval_s)
