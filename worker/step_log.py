"""Engine step times, to tell an engine's own time per token from the path's: with
`KVCLUSTER_STEP_LOG=<dir>` in its environment, every vLLM engine-core process (ours, and a
plain `vllm serve` in the same environment: both load `worker/vllm_plugin.py`) appends a line
per step to `<dir>/steps-<pid>.txt`: start and end of the step (`time.monotonic`, the same
clock in every process), tokens and requests scheduled. A step is vLLM's
`EngineCore.step`: schedule, the model worker's forward pass and sampling (through the
message queue between the two processes), and the scheduler's update. `read` and `summary`
give it back (`make bench-serve` reports the median step of one decoding request per arm).

Each line is written when its step ends (one line-buffered `write` a step, a few
microseconds against steps of milliseconds), so a reader sees every step that has ended."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ENV = "KVCLUSTER_STEP_LOG"


@dataclass(frozen=True)
class Step:
    start: float
    end: float
    tokens: int
    requests: int

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


def install(directory: str, scheduler_cls: type | None = None,
            engine_core_cls: type | None = None) -> None:
    """Record this process's engine steps into `directory` (idempotent). The classes to wrap
    are vLLM's `Scheduler` and `EngineCore` unless given."""
    if scheduler_cls is None or engine_core_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore

        scheduler_cls, engine_core_cls = scheduler_cls or Scheduler, engine_core_cls or EngineCore

    if getattr(engine_core_cls, "_kvcluster_step_log", False):
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"steps-{os.getpid()}.txt")
    log_file: list[TextIO] = []  # opened at the first step: only engine cores step
    scheduled: list[tuple[int, int]] = []
    schedule = scheduler_cls.schedule

    def counting_schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = schedule(self, *args, **kwargs)
        scheduled.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    step = engine_core_cls.step

    def timed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        scheduled.clear()
        start = time.monotonic()
        result = step(self, *args, **kwargs)
        end = time.monotonic()
        if scheduled and scheduled[0][0]:
            tokens, requests = scheduled[0]
            if not log_file:
                log_file.append(open(path, "a", buffering=1))  # open for the process
            log_file[0].write(f"{start:.6f} {end:.6f} {tokens} {requests}\n")
        return result

    scheduler_cls.schedule = counting_schedule
    engine_core_cls.step = timed_step
    engine_core_cls._kvcluster_step_log = True


def read(directory: Path | str, start: float = 0.0, end: float = float("inf")) -> list[Step]:
    """Every recorded step that began in [start, end), in order."""
    steps = []
    for path in Path(directory).glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            try:
                t0, t1, tokens, requests = line.split()
                s = Step(float(t0), float(t1), int(tokens), int(requests))
            except ValueError:  # a line cut short by the process's end
                continue
            if start <= s.start < end:
                steps.append(s)
    return sorted(steps, key=lambda s: s.start)


def summary(steps: list[Step]) -> dict[str, float]:
    """`decode1_ms`: median step that decoded one request alone (one token, one request), the
    engine's own time per token; `steps`: how many steps were recorded."""
    one = [s.ms for s in steps if s.tokens == 1 and s.requests == 1]
    return {"decode1_ms": statistics.median(one) if one else float("nan"),
            "steps": float(len(steps))}
