"""A process stopped with SIGTERM (`kill`, `pkill`, a CI timeout) stops what it started, as on
Ctrl-C: used by `make run`'s launcher, `make test-hosts` and the benchmarks.

Python's default for SIGTERM ends the process without running `finally` blocks, so the
clusters and `vllm serve` processes a benchmark started would outlive it: its direct children
die with it (`cluster.process`'s parent-death signal), but their own children, vLLM's engine
cores, do not, and go on taking the cores of whatever runs next. SIGINT is set too: a process
started with SIGINT ignored (as background jobs and some test runners start children) would
otherwise never see Ctrl-C."""

from __future__ import annotations

import signal


def stop_on_signals() -> None:
    """From now on the first SIGTERM or SIGINT raises KeyboardInterrupt in the main thread, so
    every `finally` runs; later ones are ignored, so that a second signal (a `pkill` sent
    twice, Ctrl-C pressed again) does not cut short the clean-up the first one started."""
    stopping = False

    def _interrupt(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
