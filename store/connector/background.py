"""The connector's background threads (saver, loader) and where they, and the pool client's
own threads, run."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """The calling thread free to run on any core meanwhile, and so every thread it creates.

    vLLM's CPU worker pins its OpenMP threads, the engine's main thread among them, and a
    thread inherits the affinity of the thread that creates it: pool transfers pinned beside a
    busy compute thread starve (pool reads stalled for a minute with four engines on two
    cores). The saver, the loader and the Mooncake client's threads are started unpinned."""
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


def start(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target`, free to run on any core (`unpinned`)."""
    with unpinned():
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
    return thread
