"""`embedded.supervisor`: a child that exits is started again, at once after a long run, after
a growing pause after quick deaths, and given up on after too many of them in a row. Fakes and
a hand-turned clock: no child process, no sleep."""

from __future__ import annotations

import socket

import pytest

from embedded.supervisor import GaveUp, RestartPolicy, Supervised


class FakeChild:
    """A child whose death the test decides (`die`)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.returncode: int | None = None
        self.stopped = 0

    def alive(self) -> bool:
        return self.returncode is None

    def die(self, returncode: int = -9) -> None:
        self.returncode = returncode

    def stop(self, timeout: float = 10.0) -> None:
        self.stopped += 1
        if self.returncode is None:
            self.returncode = -15

    def tail(self, lines: int = 40) -> str:
        return f"last words of child {self.n}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


POLICY = RestartPolicy(quick_deaths=3, quick_s=30.0, backoff_s=0.5, max_backoff_s=1.5)


def _supervised(policy: RestartPolicy = POLICY) -> tuple[Supervised, list[FakeChild], Clock]:
    children: list[FakeChild] = []
    clock = Clock()

    def start() -> FakeChild:
        children.append(FakeChild(len(children)))
        return children[-1]

    s = Supervised("conductor", start, policy, clock=clock)
    s.start()
    return s, children, clock


def test_a_child_alive_is_left_alone():
    s, children, clock = _supervised()
    clock.now += 100
    assert s.poll() is None
    assert len(children) == 1 and s.child is children[0] and s.restarts == 0


def test_a_child_that_ran_long_is_started_again_at_once_and_the_dead_one_reaped():
    s, children, clock = _supervised()
    clock.now += 31
    children[0].die()
    assert s.poll() is children[1]
    assert s.child is children[1] and s.restarts == 1
    assert children[0].stopped == 1  # its group swept, its scratch removed


def test_quick_deaths_back_off_doubling_up_to_the_cap_then_it_gives_up():
    policy = RestartPolicy(quick_deaths=4, quick_s=30.0, backoff_s=0.5, max_backoff_s=0.75)
    s, children, clock = _supervised(policy)
    for pause in (0.5, 0.75, 0.75):  # 0.5, then 1.0 capped at 0.75
        children[-1].die(1)
        n = len(children)
        assert s.poll() is None  # not yet: backing off
        clock.now += pause - 0.125
        assert s.poll() is None and len(children) == n
        clock.now += 0.125
        assert s.poll() is children[-1] and len(children) == n + 1
        clock.now += 1  # well within quick_s of its start
    children[-1].die(1)
    with pytest.raises(GaveUp) as e:
        s.poll()
    assert len(children) == 4  # no fifth start
    text = str(e.value)
    assert "conductor" in text and "4 times in a row" in text and "30 s" in text
    assert "last words of child 3" in text
    with pytest.raises(GaveUp):  # and it stays given up
        s.poll()


def test_a_long_run_between_quick_deaths_starts_the_count_again():
    s, children, clock = _supervised()
    for _ in range(2):  # two quick deaths: one short of giving up
        children[-1].die()
        s.poll()
        clock.now += 5
        assert s.poll() is children[-1]
    clock.now += 60  # this one ran long
    children[-1].die()
    assert s.poll() is children[-1]  # at once, and the count starts again
    for _ in range(2):
        clock.now += 1
        children[-1].die()
        s.poll()
        clock.now += 5
        assert s.poll() is children[-1]
    assert s.restarts == 5


def test_stop_stops_the_child_and_nothing_is_started_after():
    s, children, clock = _supervised()
    s.stop()
    assert children[0].stopped == 1 and s.child is None
    clock.now += 100
    assert s.poll() is None and len(children) == 1


@pytest.mark.parametrize("kwargs", [
    {"quick_deaths": 0}, {"quick_s": 0.0}, {"backoff_s": -1.0},
    {"backoff_s": 2.0, "max_backoff_s": 1.0}])
def test_a_restart_policy_out_of_range_is_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


@pytest.mark.parametrize("argv", [["--conductors", "0"], ["--conductor-restarts", "0"]])
def test_the_launcher_refuses_bad_replica_settings_with_a_message(config_only_model, argv,
                                                                  capsys):
    from embedded import spec_from_args

    with pytest.raises(SystemExit) as e:
        spec_from_args(["--model", config_only_model, *argv])
    assert e.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_the_launcher_takes_replicas_and_restarts(config_only_model):
    from embedded import spec_from_args

    spec = spec_from_args(["--model", config_only_model, "--conductors", "2",
                           "--conductor-restarts", "7"])
    assert spec.conductors == 2 and spec.conductor_restarts.quick_deaths == 7


def test_replica_ports_are_the_given_one_and_the_next_free_ones():
    from cluster.ports import free_port, ports_from

    base = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 1))
        busy.listen()
        assert ports_from(base, 3, taken={base + 2}) == [base, base + 3, base + 4]
    assert ports_from(base, 1) == [base]
    drawn = ports_from(0, 3, taken={base})
    assert len(set(drawn)) == 3 and base not in drawn
