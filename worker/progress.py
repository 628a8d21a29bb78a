"""Whether an engine makes progress: one that holds work and has not stepped for longer than
its bound is stalled, until it steps again or its engine core answers a call.

The engine owes a step from the moment it is given a request while idle, and again after
every step that leaves it work (its scheduler's running and waiting requests, as the step's
stats report them); the frontend's count of unfinished requests (`check`) catches a request
that arrived while the last step was being reported, and an engine holding nothing owes
nothing, however long it is quiet. Each step owed and taken is one sample of the engine's
step time.

The bound is `pool_wait_s + max(floor_s, factor * longest)`, `longest` the longest of the
last `window` samples: a long prompt's chunked prefill is many steps, each as long as the
engine's steps have been; a step may also wait for the pool up to its op timeout
(`pool_wait_s`); a slower machine (a busy one) gives longer samples, and so a longer bound.
The first `warmup_steps` steps after start are neither judged (nothing is known of the
engine's speed yet) nor samples (they compile and warm up: not the engine's speed); a step
that ends a stall is no sample (it measured the stall, not the engine). A check that runs
late (its event loop was blocked: the engine's outputs may be waiting unread) judges
nothing.

A step longer than `factor` times every step in the window, and than the floor, reads as a
stall: the floor must exceed the longest single step the engine can take (a full prefill
budget of a cold prompt on an engine that has only decoded so far).

Pure: the clock is injected; `worker.watchdog` drives it and tells the conductor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    seconds: float
    """How long the engine had owed a step when it was found stalled."""
    bound_s: float
    """The bound it exceeded."""
    unfinished: int
    """Requests it held."""


class Progress:
    def __init__(self, floor_s: float, factor: float, warmup_steps: int,
                 pool_wait_s: float = 0.0, window: int = 1024, check_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not floor_s > 0 or not factor >= 1 or warmup_steps < 0 or window < 1:
            raise ValueError("floor_s > 0, factor >= 1, warmup_steps >= 0, window >= 1")
        self.floor_s, self.factor, self.warmup_steps = floor_s, factor, warmup_steps
        self.pool_wait_s = pool_wait_s
        self.check_s = check_s
        """How often `check` is called (`worker.main` keeps to it)."""
        self._clock = clock
        self._samples: deque[float] = deque(maxlen=window)
        self.steps = 0
        """Steps reported since start."""
        self._owed: float | None = None
        """Since when the engine owes a step; None: it holds nothing."""
        self._checked: float | None = None
        self.stall: Stall | None = None
        """Set once the engine is found stalled; cleared by its next step or answer."""

    def submitted(self) -> None:
        """A request was given to the engine."""
        if self._owed is None:
            self._owed = self._clock()

    def stepped(self, more: bool) -> None:
        """The engine reported a step; `more`: it holds work after it."""
        now = self._clock()
        self.steps += 1
        if self._owed is not None and self.stall is None and self.steps > self.warmup_steps:
            self._samples.append(now - self._owed)
        self.stall = None
        self._owed = now if more else None

    def answered(self) -> None:
        """The engine core answered a call: its loop runs; a step it owes is owed from now."""
        if self.stall is not None:
            self.stall = None
            if self._owed is not None:
                self._owed = self._clock()

    def bound_s(self) -> float:
        longest = max(self._samples, default=0.0)
        return self.pool_wait_s + max(self.floor_s, self.factor * longest)

    def check(self, unfinished: int) -> Stall | None:
        """The verdict now, given the requests the engine's frontend holds unfinished."""
        now = self._clock()
        late = self._checked is not None and now - self._checked > 2 * self.check_s
        self._checked = now
        if unfinished <= 0:
            self._owed = None
        elif self._owed is None:
            self._owed = now
        if self.stall is not None or late or self._owed is None \
                or self.steps < self.warmup_steps:
            return self.stall
        bound = self.bound_s()
        if now - self._owed > bound:
            self.stall = Stall(now - self._owed, bound, unfinished)
        return self.stall
