"""The connector's background threads (saver, loader) and where they, and the pool client's
own threads, run."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread free to run on any core, at normal priority, meanwhile, and so
    every thread it creates.

    vLLM's CPU worker pins its OpenMP threads, the engine's main thread among them, and a
    thread inherits the affinity of the thread that creates it: pool transfers pinned beside a
    busy compute thread starve (pool reads stalled for a minute with four engines on two
    cores). A background engine's threads run at `SCHED_IDLE` (`worker/vllm_plugin.py`), and
    its Mooncake client's transfer threads serve the other engines' reads of its segment: at
    `SCHED_IDLE` they starved while the serving processes were busy (a decode's read of a
    prefill's blocks gave up after the pool's 5 s timeout with one stream running). The saver,
    the loader and the Mooncake client's threads are started unpinned, at normal priority."""
    with _affinity_all(), _normal_priority():
        yield


@contextlib.contextmanager
def _affinity_all() -> Iterator[None]:
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _normal_priority() -> Iterator[None]:
    idle = getattr(os, "SCHED_IDLE", None)
    try:
        lifted = idle is not None and os.sched_getscheduler(0) == idle
        if lifted:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # not allowed (RLIMIT_NICE): the threads stay where they are
        lifted = False
    try:
        yield
    finally:
        if lifted:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, idle, os.sched_param(0))


def start(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target` on any core, at normal priority (`unpinned`)."""
    with unpinned():
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    return thread
