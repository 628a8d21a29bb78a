"""The engine watchdog's logic (`worker.progress`, `worker.watchdog`) on a fake clock: no
engine, no sleeps."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1 import health, health_pb2

from cluster.health import SERVICE, STALLED
from worker.progress import Progress
from worker.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def watch(clock: Clock, floor_s: float = 3.0, factor: float = 10.0, warmup: int = 2,
          pool_wait_s: float = 0.0) -> Progress:
    return Progress(floor_s, factor, warmup, pool_wait_s=pool_wait_s, check_s=0.5, clock=clock)


def run(clock: Clock, p: Progress, seconds: float, unfinished: int = 1, step_s: float = 0.0,
        more: bool = True):
    """`seconds` of checks every 0.5 s, the engine stepping every `step_s` (0: never); the
    last verdict."""
    verdict, next_step = None, clock.t + step_s
    end = clock.t + seconds
    while clock.t < end:
        clock.t = min(clock.t + 0.5, end)
        while step_s and next_step <= clock.t:
            p.stepped(more)
            next_step += step_s
        verdict = p.check(unfinished)
    return verdict


def warmed(clock: Clock, **kw) -> Progress:
    p = watch(clock, **kw)
    p.submitted()
    for _ in range(4):  # two to warm up, two timed
        clock.t += 0.02
        p.stepped(True)
    p.check(1)
    return p


def test_an_engine_holding_work_that_does_not_step_is_stalled_past_its_floor():
    clock = Clock()
    p = warmed(clock)
    assert p.bound_s() == 3.0  # 10 x 20 ms is under the floor
    assert run(clock, p, 3.0) is None
    stall = run(clock, p, 1.0)
    assert stall is not None and stall.bound_s == 3.0 and 3.0 < stall.seconds <= 3.5
    assert stall.unfinished == 1


def test_the_bound_follows_the_longest_recent_step_and_the_pool_timeout():
    clock = Clock()
    p = warmed(clock, pool_wait_s=5.0)
    assert p.bound_s() == 8.0
    assert run(clock, p, 20.0, step_s=1.0) is None  # steps of 1 s: the bound becomes 15 s
    assert p.bound_s() == pytest.approx(15.0)
    assert run(clock, p, 14.5) is None
    assert run(clock, p, 1.0) is not None


def test_a_long_chunked_prefill_of_many_bounded_steps_is_not_a_stall():
    clock = Clock()
    p = warmed(clock)
    assert run(clock, p, 120.0, step_s=2.5) is None  # each under the floor, for two minutes


def test_an_idle_engine_never_stalls():
    clock = Clock()
    p = warmed(clock)
    p.stepped(False)  # its last request finished
    assert run(clock, p, 600.0, unfinished=0) is None


def test_a_request_given_to_an_idle_engine_is_owed_a_step_from_then():
    clock = Clock()
    p = warmed(clock)
    p.stepped(False)
    run(clock, p, 100.0, unfinished=0)
    p.submitted()
    assert run(clock, p, 2.9) is None  # not the 100 s it was idle
    assert run(clock, p, 1.0) is not None


def test_a_request_the_last_step_did_not_see_is_found_by_the_check():
    clock = Clock()
    p = warmed(clock)
    p.stepped(False)  # says it holds nothing, but the frontend holds one
    assert run(clock, p, 3.0, unfinished=1) is None
    assert run(clock, p, 1.0, unfinished=1) is not None


def test_the_first_steps_after_start_are_not_judged():
    clock = Clock()
    p = watch(clock, warmup=2)
    p.submitted()
    assert run(clock, p, 60.0) is None  # the first step compiles, say
    p.stepped(True)
    assert run(clock, p, 60.0) is None  # one step: still warming up
    p.stepped(True)
    assert p.bound_s() == 3.0  # 60 s steps while warming up are not its speed
    assert run(clock, p, 2.5) is None
    p.stepped(True)  # the first step timed: 2.5 s
    assert p.bound_s() == pytest.approx(25.0)
    assert run(clock, p, 24.5) is None
    assert run(clock, p, 1.0) is not None


def test_a_late_check_judges_nothing():
    """The worker's event loop was blocked: the engine's outputs may be queued unread."""
    clock = Clock()
    p = warmed(clock)
    clock.t += 10.0
    assert p.check(1) is None
    clock.t += 0.5
    assert p.check(1) is not None


def test_a_stall_lasts_until_the_engine_steps_and_is_no_sample():
    clock = Clock()
    p = warmed(clock)
    assert run(clock, p, 4.0) is not None
    assert run(clock, p, 30.0, unfinished=0) is not None  # its requests were cancelled
    p.stepped(True)
    assert p.stall is None and p.bound_s() == 3.0  # 34 s was the stall, not a step
    assert run(clock, p, 2.0, step_s=0.1) is None


def test_an_answer_of_the_engine_core_ends_a_stall():
    clock = Clock()
    p = warmed(clock)
    assert run(clock, p, 4.0) is not None
    p.answered()  # it came back with nothing left to do: no step will come
    assert run(clock, p, 30.0, unfinished=0) is None


@pytest.mark.parametrize("kw", [{"floor_s": 0}, {"factor": 0.5}, {"warmup": -1}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        watch(Clock(), **kw)


def test_the_watchdog_says_stalled_in_the_health_service_and_serving_when_it_answers():
    async def main() -> None:
        clock = Clock()
        p = warmed(clock)
        servicer = health.aio.HealthServicer()
        await servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        answer = asyncio.Event()
        pings = []

        async def ping() -> None:
            pings.append(clock.t)
            await answer.wait()

        dog = Watchdog(p, lambda: 1, ping, servicer, "decode-0")

        async def status() -> int:
            req = health_pb2.HealthCheckRequest(service=SERVICE)
            return (await servicer.Check(req, None)).status

        for _ in range(8):
            clock.t += 0.5
            await dog.check()
        assert await status() == STALLED and dog.stalled
        await asyncio.sleep(0)
        assert len(pings) == 1  # one call asked, unanswered (a stopped engine core)
        clock.t += 0.5
        await dog.check()
        assert len(pings) == 1
        answer.set()
        await asyncio.sleep(0)
        clock.t += 0.5
        await dog.check()
        assert await status() == health_pb2.HealthCheckResponse.SERVING and not dog.stalled
        await dog.close()

    asyncio.run(main())


def test_the_watchdog_leaves_a_draining_worker_not_serving():
    async def main() -> None:
        clock = Clock()
        p = warmed(clock)
        servicer = health.aio.HealthServicer()
        await servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await servicer.enter_graceful_shutdown()

        async def ping() -> None:
            await asyncio.Event().wait()

        dog = Watchdog(p, lambda: 1, ping, servicer)
        for _ in range(8):
            clock.t += 0.5
            await dog.check()
        assert dog.stalled
        reply = await servicer.Check(health_pb2.HealthCheckRequest(service=SERVICE), None)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await dog.close()

    asyncio.run(main())
