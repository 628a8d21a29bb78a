"""A benchmark stopped with SIGTERM (`kill`, `pkill`, a CI timeout) cleans up as on Ctrl-C.

Python's default for SIGTERM ends the process without running `finally` blocks, so the
clusters and `vllm serve` processes a benchmark started outlived it: its direct children die
with it (`cluster.process`'s parent-death signal), but their own children, vLLM's engine
cores, did not, and went on taking the cores of whatever ran next (seen 2026-11-26 after a
`pkill` of `make bench-serve`)."""

from __future__ import annotations

import signal


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread: every `finally` runs."""
    signal.signal(signal.SIGTERM, _interrupt)
