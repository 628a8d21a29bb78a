"""What machine a benchmark ran on, for the line every benchmark prints first."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def describe() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu_model()}), {mem:.0f} GiB, "
            f"Python {platform.python_version()}")


def cpu_probe_s(n: int = 3_000_000, repeat: int = 3) -> float:
    """Seconds a fixed pure-Python loop takes (the best of `repeat`; ~0.06 s here): the
    machine's speed now. This machine has phases in which everything, this loop too, runs
    1.5-2x slower with no steal reported; a benchmark records the probe beside each arm, taken
    while nothing of its own runs, so that a slow phase shows as one instead of passing for a
    regression."""
    import time

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        sum(range(n))
        best = min(best, time.perf_counter() - t0)
    return best


class StallWatch:
    """Host stalls during a measurement: a thread that wakes every `tick_s` and records each
    wake-up that came more than `min_gap_s` late, seconds in which this process got no CPU
    (the machine paused, or the scheduler starved it: seen here for 0.25-7 s at a time when
    every cluster process was a session of its own, `cluster/process.py`); every request in
    flight then gains that time. A benchmark reports them beside its figures."""

    def __init__(self, tick_s: float = 0.01, min_gap_s: float = 0.25) -> None:
        import threading

        self.tick_s, self.min_gap_s = tick_s, min_gap_s
        self.stalls: list[float] = []
        """Seconds lost per stall, in order."""
        self._stop = threading.Event()
        self._watching = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        self._watching.wait()  # from here on a stall is seen
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import time

        last = time.monotonic()
        self._watching.set()
        stopped = False
        while not stopped:
            # the last wake-up is measured too: a stall that ends with the watch (the caller
            # resumed first and stopped it) counts (a test froze the process and saw none)
            stopped = self._stop.wait(self.tick_s)
            now = time.monotonic()
            if now - last - self.tick_s > self.min_gap_s:
                self.stalls.append(round(now - last - self.tick_s, 3))
            last = now
