"""Worker calls and channels the conductor lets finish without awaiting them.

Each runs as a task the module keeps a reference to until it is done: the event loop holds
only weak references to tasks, so an unreferenced one can be collected before it ends (and a
call collected unfinished is cancelled)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import grpc

from conductor.resilience import WorkerFailure

_RUNNING: set[asyncio.Task] = set()
CLOSE_WAIT_S = 5.0
"""How long a decode call whose every choice finished may take to end on its own."""


def _keep(coro: Coroutine[Any, Any, Any]) -> None:
    try:
        task = asyncio.get_running_loop().create_task(coro)
    except RuntimeError:  # no running loop: nothing to run it on
        coro.close()
        return
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)


def close_call_later(call: grpc.aio.UnaryStreamCall) -> None:
    """The decode's stream after its last chunk: its end (the worker's status, ~1 ms later on
    two busy cores) is not waited for by the answer, but by a task that keeps the call alive
    until then (a call collected unfinished is cancelled, and the worker would count an
    abort) and cancels it after `CLOSE_WAIT_S`."""
    async def close() -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await call.code()
        call.cancel()

    _keep(close())


def close_channel_later(channel: grpc.aio.Channel, grace_s: float) -> None:
    """Close `channel` once its calls in flight ended, cancelling them after `grace_s`."""
    _keep(channel.close(grace=grace_s))


async def settle(task: asyncio.Task) -> None:
    """A prefill task the decode no longer waits for: cancelled if still running (the client
    went away, or the decode ended first), its failure already counted."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, WorkerFailure):
        await task
