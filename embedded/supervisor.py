"""A child of the launcher kept running (the conductor replicas of `make run`).

A child that exits is reaped and started again with the same command: at once when it had run
for `RestartPolicy.quick_s` or longer; after a pause that doubles with each further quick death
otherwise; and not at all once it died quickly `RestartPolicy.quick_deaths` times in a row
(`GaveUp`, with the last lines of its log), since a child that dies at once after every
start would otherwise be restarted forever. `Supervised.poll` never waits: the caller's loop
calls it, and the clock is handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

QUICK_DEATHS = 5
QUICK_S = 30


class Child(Protocol):
    """What is supervised: a `cluster.process.ManagedProcess`, or a test's fake."""

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def tail(self, lines: int = 40) -> str: ...


class GaveUp(RuntimeError):
    """A supervised child died quickly too many times in a row; it is not started again."""


@dataclass(frozen=True)
class RestartPolicy:
    quick_deaths: int = QUICK_DEATHS
    """Deaths in a row, each within `quick_s` of its start, after which the child is given up
    on (`GaveUp`)."""
    quick_s: float = QUICK_S
    """A child that exits sooner than this after its start died quickly."""
    backoff_s: float = 0.5
    """The pause before the start that follows a first quick death, doubled for each further
    one in a row, at most `max_backoff_s`. After a longer run: no pause."""
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.quick_deaths < 1:
            raise ValueError(f"quick_deaths must be at least 1, got {self.quick_deaths}")
        if self.quick_s <= 0:
            raise ValueError(f"quick_s must be positive, got {self.quick_s}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"backoff_s must be in [0, max_backoff_s={self.max_backoff_s}], "
                             f"got {self.backoff_s}")

    def pause(self, quick_deaths: int) -> float | None:
        """Seconds to wait before the next start after `quick_deaths` quick deaths in a row
        (0: the last run was long); None: give up."""
        if quick_deaths >= self.quick_deaths:
            return None
        if quick_deaths == 0:
            return 0.0
        return min(self.backoff_s * 2 ** (quick_deaths - 1), self.max_backoff_s)


class Supervised:
    """One child, started by `start()` and kept running by `poll()` until `stop()`."""

    def __init__(self, name: str, start: Callable[[], Child], policy: RestartPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`start` makes and starts a new child (the same command each time)."""
        self.name = name
        self.policy = policy
        self.child: Child | None = None
        self.restarts = 0
        self._start = start
        self._clock = clock
        self._started_at = 0.0
        self._quick_deaths = 0
        self._due: float | None = None
        """When the next start is due, while one is pending."""
        self._gave_up: GaveUp | None = None

    def start(self) -> Child:
        self.child = self._start()
        self._started_at = self._clock()
        self._due = None
        return self.child

    def poll(self) -> Child | None:
        """The new child if one was started now, else None. A child found dead is reaped and
        its start scheduled by the policy; `GaveUp` when the policy says no more (and on every
        call after)."""
        if self._gave_up is not None:
            raise self._gave_up
        if self.child is None:
            return None
        now = self._clock()
        if self._due is None:
            if self.child.alive():
                return None
            self._died(now)
        if now < self._due:  # type: ignore[operator]
            return None
        self.start()
        self.restarts += 1
        log.info("child_restarted", name=self.name, restarts=self.restarts)
        return self.child

    def _died(self, now: float) -> None:
        assert self.child is not None
        self.child.stop()  # reaped: what its group left running, and its scratch directory
        ran = now - self._started_at
        self._quick_deaths = self._quick_deaths + 1 if ran < self.policy.quick_s else 0
        pause = self.policy.pause(self._quick_deaths)
        if pause is None:
            self._gave_up = GaveUp(
                f"{self.name} exited {self._quick_deaths} times in a row, each within "
                f"{self.policy.quick_s:.0f} s of its start (last status "
                f"{self.child.returncode}); not starting it again. Its last log lines:\n"
                f"{self.child.tail()}")
            raise self._gave_up
        log.warning("child_died", name=self.name, returncode=self.child.returncode,
                    ran_s=round(ran, 1), quick_deaths=self._quick_deaths, restart_in_s=pause,
                    log_tail=self.child.tail(10))
        self._due = now + pause

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child; nothing is started after."""
        child, self.child, self._due = self.child, None, None
        if child is not None:
            child.stop(timeout)
