"""The mechanisms every component recovers with: a circuit breaker, a jittered backoff and a
retry budget.

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
    that it is half-open: one more failure opens it at once. A user that routes by it
    (`admits`, `probe`) sends one call, the probe, while it is half-open; the probe's verdict
    closes it (`succeeded`) or opens it again (`failed`), and a probe that ended without one
    (`abandon_probe`) lets the next call probe."""

    def __init__(self, cooldown_s: float, threshold: int = 1) -> None:
        self.cooldown_s = cooldown_s
        self.threshold = threshold
        self.failures = 0
        """Failures in a row (a success resets them)."""
        self.open_until = 0.0
        """Monotonic time the cool-down ends; 0: closed or half-open."""
        self.trial = False
        """Half-open: its cool-down ended and no call has succeeded since."""
        self.prober: str | None = None
        """The call probing it while half-open (None: none out)."""

    @property
    def open(self) -> bool:
        """Open (in its cool-down, or past it and not yet `half_open`ed)."""
        return self.open_until > 0.0

    def admits(self) -> bool:
        """A call may be routed here: closed, or half-open with no probe out."""
        return not self.open and self.prober is None

    def probe(self, caller: str) -> bool:
        """`caller` is routed here: half-open, it becomes the one probe (False if another
        one is out). Closed: True, nothing taken."""
        if not self.trial:
            return True
        if self.prober is not None:
            return False
        self.prober = caller
        return True

    def abandon_probe(self, caller: str) -> None:
        """`caller` ended without a verdict (cancelled): if it was the probe, the next call
        probes."""
        if self.prober == caller:
            self.prober = None

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
        self.trial, self.prober = False, None
        now = time.monotonic() if now is None else now
        self.open_until = now + (self.cooldown_s if cooldown_s is None else cooldown_s)
        return opened

    def succeeded(self) -> None:
        self.failures = 0
        self.trial, self.prober = False, None

    def half_open(self, now: float | None = None) -> bool:
        """An open breaker whose cool-down is over turns half-open (True then)."""
        now = time.monotonic() if now is None else now
        if not self.open or self.open_until > now:
            return False
        self.open_until = 0.0
        self.failures = max(self.failures, self.threshold - 1)
        self.trial, self.prober = True, None
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


class RetryBudget:
    """Retries as a share of traffic: over the last `window_s`, retries may number `ratio`
    times the requests plus `floor` (a quiet service still retries its few failures); beyond
    that a failure is the answer, so that failures never multiply the load (retry storms)."""

    def __init__(self, ratio: float, floor: int = 3, window_s: float = 10.0,
                 buckets: int = 10) -> None:
        self.ratio, self.floor = ratio, floor
        self._width = window_s / buckets
        self._requests = [0] * buckets
        self._retries = [0] * buckets
        self._at = 0
        """The bucket of the latest `_roll` (an absolute bucket number)."""

    def _roll(self, now: float) -> int:
        at = int(now / self._width)
        n = len(self._requests)
        if at - self._at >= n:
            self._requests[:] = [0] * n
            self._retries[:] = [0] * n
        else:
            for b in range(self._at + 1, at + 1):
                self._requests[b % n] = self._retries[b % n] = 0
        self._at = max(self._at, at)
        return self._at % n

    def request(self, now: float | None = None) -> None:
        """A request arrived: it earns its share of a retry."""
        self._requests[self._roll(time.monotonic() if now is None else now)] += 1

    def try_retry(self, now: float | None = None) -> bool:
        """Take a retry if the budget has one (True), else False."""
        b = self._roll(time.monotonic() if now is None else now)
        if sum(self._retries) >= self.floor + self.ratio * sum(self._requests):
            return False
        self._retries[b] += 1
        return True
