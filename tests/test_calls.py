"""Worker calls and channels left to finish on their own (`conductor.calls`)."""

import asyncio
import gc
import warnings

import grpc
import pytest

from conductor import calls
from conductor.errors import UpstreamFailed
from conductor.resilience import WorkerFailure


class _Channel:
    """A channel whose close ends when told: what `close_channel_later` must see through."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed_with: float | None = None

    async def close(self, grace: float | None = None) -> None:
        self.closed_with = grace
        await self.release.wait()


async def test_a_channel_closes_later_and_its_task_outlives_a_collection():
    channel = _Channel()
    calls.close_channel_later(channel, 2.5)  # type: ignore[arg-type]
    gc.collect()  # the loop holds tasks weakly: the module must keep it
    await asyncio.sleep(0)
    assert channel.closed_with == 2.5 and len(calls._RUNNING) == 1
    channel.release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert not calls._RUNNING


def test_without_a_running_loop_nothing_is_left_unawaited():
    channel = _Channel.__new__(_Channel)  # no loop to make its event on

    async def close(grace=None):
        raise AssertionError("not run")

    channel.close = close  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        calls.close_channel_later(channel, 1.0)  # type: ignore[arg-type]
        gc.collect()
    assert not [w for w in seen if "never awaited" in str(w.message)]
    assert not calls._RUNNING


async def test_settle_cancels_a_running_prefill_and_swallows_its_counted_failure():
    started = asyncio.Event()

    async def forever():
        started.set()
        await asyncio.Event().wait()

    running = asyncio.get_running_loop().create_task(forever())
    await started.wait()
    await calls.settle(running)
    assert running.cancelled()

    async def fails():
        raise WorkerFailure("p-0", grpc.StatusCode.UNAVAILABLE, UpstreamFailed("down"))

    failed = asyncio.get_running_loop().create_task(fails())
    await asyncio.sleep(0)
    await calls.settle(failed)  # counted where it failed: nothing to raise here

    async def breaks():
        raise ValueError("a bug, not a worker failure")

    broken = asyncio.get_running_loop().create_task(breaks())
    await asyncio.sleep(0)
    with pytest.raises(ValueError):
        await calls.settle(broken)
