"""A worker's engine watchdog: its health says `STALLED` (`cluster.health`) while its engine
holds requests and makes no progress (`worker.progress`), SERVING again once the engine
steps or its engine core answers a call (asked while stalled: an engine that comes back
with nothing left to do takes no step). Once the health service entered graceful shutdown
it says NOT_SERVING, whatever the watchdog finds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from grpc_health.v1 import health, health_pb2

from cluster.health import SERVICE, STALLED
from worker.progress import Progress

log = structlog.get_logger(__name__)


class Watchdog:
    def __init__(self, progress: Progress, unfinished: Callable[[], int],
                 ping: Callable[[], Awaitable[None]], health_servicer: health.aio.HealthServicer,
                 instance_id: str = "") -> None:
        self.progress = progress
        self._unfinished = unfinished
        self._ping = ping
        self._health = health_servicer
        self._instance_id = instance_id
        self._asking: asyncio.Task | None = None
        self.stalled = False

    async def check(self) -> None:
        """Judge now (the caller calls it every `progress.check_s`) and say it."""
        stall = self.progress.check(self._unfinished())
        if stall is not None and self._asking is None:
            self._asking = asyncio.ensure_future(self._ask())
        if (stall is not None) == self.stalled:
            return
        self.stalled = stall is not None
        if stall is not None:
            log.error("engine_stalled", instance_id=self._instance_id, unfinished=stall.unfinished,
                      seconds=round(stall.seconds, 2), bound_s=round(stall.bound_s, 2))
            status = STALLED
        else:
            log.info("engine_progressing", instance_id=self._instance_id)
            status = health_pb2.HealthCheckResponse.SERVING
        for service in ("", SERVICE):
            await self._health.set(service, status)

    async def _ask(self) -> None:
        try:
            await self._ping()
        except asyncio.CancelledError:
            raise
        except Exception:  # a dead engine: `Engine.dead` says so
            return
        finally:
            self._asking = None
        self.progress.answered()

    async def close(self) -> None:
        task = self._asking
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
