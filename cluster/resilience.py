"""The mechanisms every component recovers with: a circuit breaker and a jittered backoff.

Used by the conductor's registry (one breaker per instance) and its retries
(`conductor/resilience.py` decides what a failure leads to), by the KV pool client (one
breaker for its master) and by etcd membership (backoff between reconnects). Not
thread-safe: each user holds its own lock where calls race.
"""

from __future__ import annotations

import random
import time


class Breaker:
    """`threshold` failures in a row, or one `fatal` failure, open it for a cool-down; after
    that it is half-open: calls pass again, and one more failure opens it at once."""

    def __init__(self, cooldown_s: float, threshold: int = 1) -> None:
        self.cooldown_s = cooldown_s
        self.threshold = threshold
        self.failures = 0
        """Failures in a row (a success resets them)."""
        self.open_until = 0.0
        """Monotonic time the cool-down ends; 0: closed or half-open."""

    @property
    def open(self) -> bool:
        """Open (in its cool-down, or past it and not yet `half_open`ed)."""
        return self.open_until > 0.0

    def allows(self, now: float | None = None) -> bool:
        """A call may go now: closed, or its cool-down is over."""
        return (time.monotonic() if now is None else now) >= self.open_until

    def failed(self, fatal: bool = False, cooldown_s: float | None = None,
               now: float | None = None) -> bool:
        """Count a failure; True when it opened a breaker that was not open. An open one's
        cool-down starts again."""
        self.failures += 1
        if not (fatal or self.failures >= self.threshold):
            return False
        opened = not self.open
        now = time.monotonic() if now is None else now
        self.open_until = now + (self.cooldown_s if cooldown_s is None else cooldown_s)
        return opened

    def succeeded(self) -> None:
        self.failures = 0

    def half_open(self, now: float | None = None) -> bool:
        """An open breaker whose cool-down is over turns half-open (True then)."""
        now = time.monotonic() if now is None else now
        if not self.open or self.open_until > now:
            return False
        self.open_until = 0.0
        self.failures = max(self.failures, self.threshold - 1)
        return True


class Backoff:
    """Doubling delays from `first` up to `cap`, each jittered by ±`jitter` (a fraction)."""

    def __init__(self, first: float, cap: float, jitter: float = 0.2) -> None:
        self.first, self.cap, self.jitter = first, cap, jitter
        self._next = first

    def reset(self) -> None:
        self._next = self.first

    def next(self) -> float:
        delay, self._next = self._next, min(self.cap, self._next * 2)
        return delay * random.uniform(1 - self.jitter, 1 + self.jitter)

    def nth(self, n: int) -> float:
        """The `n`-th delay (1-based), jittered, without changing this backoff's state."""
        return (min(self.cap, self.first * 2 ** (max(n, 1) - 1))
                * random.uniform(1 - self.jitter, 1 + self.jitter))
