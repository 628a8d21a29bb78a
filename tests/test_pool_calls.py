"""Calls given up on (`store.pool.calls.InFlight`): what keeps a pool unavailable, and what a
fresh call to the master releases. Fakes with gates; the real network case is in
tests/test_pool_partition.py."""

from __future__ import annotations

import threading

import pytest
from conftest import wait_until

from store.pool.calls import InFlight

WAIT_S = 10.0


class _Probe:
    """A probe that blocks until `answer`ed: each call is an entry of `answers`, in order."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.answers: list[tuple[threading.Event, bool]] = []
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        gate = threading.Event()
        with self._lock:
            self.answers.append((gate, False))
            i = len(self.answers) - 1
        self.started.release()
        gate.wait(WAIT_S)
        return self.answers[i][1]

    def answer(self, i: int, value: bool) -> None:
        gate, _ = self.answers[i]
        self.answers[i] = (gate, value)
        gate.set()


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(InFlight, "PROBE_INTERVAL_S", 0.01)
    monkeypatch.setattr(InFlight, "PROBE_SPACING_S", 0.0)


def test_a_stuck_master_call_is_released_when_a_fresh_call_answers(fast):
    calls, probe = InFlight("m"), _Probe()
    token = calls.begin()
    assert calls.give_up(token, master_only=True) and calls.holding()
    calls.watch(probe, lambda: True)
    assert probe.started.acquire(timeout=WAIT_S)
    assert calls.holding()  # not before the probe answers
    probe.answer(0, True)
    wait_until(lambda: not calls.holding(), WAIT_S, "released")
    assert token in calls.running  # still accounted until it returns
    calls.end(token)
    assert not calls.running


def test_a_stuck_transfer_holds_the_pool_until_it_returns(fast):
    calls, probe = InFlight("m"), _Probe()
    transfer, lookup = calls.begin(), calls.begin()
    calls.give_up(transfer, master_only=False)
    calls.give_up(lookup, master_only=True)
    calls.watch(probe, lambda: True)
    assert probe.started.acquire(timeout=WAIT_S)
    probe.answer(0, True)
    wait_until(lambda: lookup not in calls.stuck, WAIT_S, "the lookup released")
    assert calls.holding() and transfer in calls.stuck
    calls.end(transfer)
    assert not calls.holding()


def test_a_stuck_probe_does_not_stop_the_next_and_a_late_answer_counts(fast):
    calls, probe = InFlight("m"), _Probe()
    token = calls.begin()
    calls.give_up(token, master_only=True)
    calls.watch(probe, lambda: True)
    for _ in range(InFlight.PROBES_MAX):
        assert probe.started.acquire(timeout=WAIT_S)
    assert not probe.started.acquire(timeout=0.2)  # at most PROBES_MAX stuck at once
    probe.answer(0, False)  # one returns, unanswered: room for another
    assert probe.started.acquire(timeout=WAIT_S)
    assert calls.holding()
    probe.answer(1, True)  # an earlier probe answering late still releases
    wait_until(lambda: not calls.holding(), WAIT_S, "released")
    for i in range(2, len(probe.answers)):
        probe.answer(i, False)
    wait_until(lambda: calls.running == {token}, WAIT_S, "the probes ended")


def test_a_probe_releases_only_the_calls_stuck_when_it_began(fast):
    calls, probe = InFlight("m"), _Probe()
    first = calls.begin()
    calls.give_up(first, master_only=True)
    calls.watch(probe, lambda: True)
    assert probe.started.acquire(timeout=WAIT_S)
    second = calls.begin()
    calls.give_up(second, master_only=True)
    probe.answer(0, True)
    wait_until(lambda: first not in calls.stuck, WAIT_S, "the first released")
    assert second in calls.stuck
    assert probe.started.acquire(timeout=WAIT_S)  # the watch goes on for the second
    probe.answer(1, True)
    wait_until(lambda: not calls.holding(), WAIT_S, "the second released")


def test_no_probe_while_the_master_does_not_look_reachable_and_none_once_closed(fast):
    calls, probe = InFlight("m"), _Probe()
    ready = threading.Event()
    token = calls.begin()
    calls.give_up(token, master_only=True)
    calls.watch(probe, ready.is_set)
    assert not probe.started.acquire(timeout=0.2)
    calls.close()
    ready.set()
    assert calls.begin() is None
    assert not probe.started.acquire(timeout=0.2)
    assert calls.holding()  # closing releases nothing: the call is still out


def test_a_call_that_returned_before_its_caller_gave_up_is_not_stuck():
    calls = InFlight("m")
    token = calls.begin()
    calls.end(token)
    assert not calls.give_up(token, master_only=True)
    assert not calls.holding() and not calls.running
