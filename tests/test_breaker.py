"""The shared recovery mechanisms (`cluster/resilience.py`): breaker states and backoff."""

from __future__ import annotations

from cluster.resilience import Backoff, Breaker, RetryBudget


def test_a_breaker_opens_at_the_threshold_and_half_opens_after_its_cooldown() -> None:
    b = Breaker(cooldown_s=2.0, threshold=3)
    assert not b.failed(now=0.0) and not b.failed(now=0.0) and b.allows(now=0.0)
    assert b.failed(now=1.0)  # the third in a row opens it
    assert b.open and not b.allows(now=2.9) and b.allows(now=3.0)
    assert not b.half_open(now=2.9) and b.half_open(now=3.0) and not b.open
    assert b.failed(now=4.0)  # half-open: one more failure opens it at once
    assert not b.failed(now=5.0) and b.open_until == 7.0  # again: the cool-down restarts


def test_a_success_resets_the_count_and_a_fatal_failure_opens_at_once() -> None:
    b = Breaker(cooldown_s=1.0, threshold=3)
    b.failed(now=0.0)
    b.failed(now=0.0)
    b.succeeded()
    assert not b.failed(now=0.0) and not b.open
    assert b.failed(fatal=True, cooldown_s=5.0, now=0.0) and b.open_until == 5.0


def test_backoff_doubles_to_its_cap_within_its_jitter() -> None:
    b = Backoff(0.1, 1.0, jitter=0.2)
    delays = [b.next() for _ in range(6)]
    for got, want in zip(delays, (0.1, 0.2, 0.4, 0.8, 1.0, 1.0), strict=True):
        assert want * 0.8 <= got <= want * 1.2
    b.reset()
    assert b.next() <= 0.12
    assert 0.4 * 0.8 <= b.nth(3) <= 0.4 * 1.2 and b.nth(50) <= 1.2


def test_a_half_open_breaker_admits_one_probe_whose_verdict_closes_or_reopens_it() -> None:
    b = Breaker(cooldown_s=1.0, threshold=3)
    b.failed(fatal=True, now=0.0)
    assert not b.admits() and b.half_open(now=1.0) and b.admits()
    assert b.probe("a") and not b.admits() and not b.probe("b")
    b.abandon_probe("b")  # not the probe: nothing changes
    assert not b.admits()
    b.abandon_probe("a")  # the probe ended without a verdict (its client left): another may
    assert b.admits() and b.probe("b") and not b.admits()
    b.succeeded()
    assert b.admits() and b.probe("c") and b.admits()  # closed: nothing to take, no limit
    b.failed(fatal=True, now=2.0)
    assert b.half_open(now=3.0) and b.probe("d")
    assert b.failed(now=3.5) and not b.admits() and b.open_until == 4.5  # the probe failed


def test_a_retry_budget_allows_its_floor_then_its_share_of_recent_requests() -> None:
    b = RetryBudget(ratio=0.2, floor=2, window_s=10.0)
    assert b.try_retry(now=0.0) and b.try_retry(now=0.0) and not b.try_retry(now=0.0)
    for _ in range(10):
        b.request(now=1.0)
    assert b.try_retry(now=1.0) and b.try_retry(now=1.0) and not b.try_retry(now=1.0)
    assert not b.try_retry(now=9.9)
    assert b.try_retry(now=10.5)  # the retries of t=0 left the window
    assert b.try_retry(now=30.0) and b.try_retry(now=30.0) and not b.try_retry(now=30.0)
