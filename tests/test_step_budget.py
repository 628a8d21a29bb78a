"""`worker.step_budget`: while streams run, a step's tokens fit a target time by the engine's own
learned step cost and shrink with the context its prompt chunk attends to; while none does, a
step gets the engine's whole budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from worker.step_budget import (
    MIN_CHUNK,
    StepCost,
    budget,
    install,
    install_control,
    set_target,
)


def test_the_budget_halves_at_the_given_context_and_never_starves_a_stream():
    assert budget(256, 0, 2000, 0) == 256
    assert budget(256, 2000, 2000, 0) == 128
    assert budget(256, 6000, 2000, 0) == 64
    assert budget(256, 6000, 2000, 100) == 100 + MIN_CHUNK  # every stream's token, and a chunk
    assert budget(64, 0, 2000, 100) == 64  # never above the configured budget


@dataclass
class _Req:
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass
class _Out:
    total_num_scheduled_tokens: int


@dataclass
class _Scheduler:
    """vLLM's `Scheduler` as the budget sees it: it schedules the whole budget."""
    max_num_scheduled_tokens: int = 2048
    running: list = field(default_factory=list)
    seen: list = field(default_factory=list)
    updated: list = field(default_factory=list)

    def schedule(self, wanted: int = 10**9) -> _Out:
        self.seen.append(self.max_num_scheduled_tokens)
        return _Out(min(self.max_num_scheduled_tokens, wanted))

    def update_from_output(self, out: _Out, model_output: object) -> str:
        self.updated.append(out)
        return "outputs"


def test_a_step_beside_streams_gets_the_budget_of_its_longest_running_prompt():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    install(1000, 64, cls)  # idempotent: the first stays
    s = cls()
    s.running = [_Req(2000, 3000), _Req(500, 3000), _Req(40, 20)]  # two prompts, one stream
    s.schedule()
    s.running = [_Req(3000, 3000)]  # its prompt done: a stream
    s.schedule()
    assert s.seen == [128, 256]


def test_a_step_with_no_stream_to_hold_up_gets_the_engines_whole_budget():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    s = cls()
    s.schedule()  # nothing running
    s.running = [_Req(2000, 3000), _Req(0, 3000)]  # prompts only, deep in one of them
    s.schedule()
    s.running.append(_Req(3000, 3000))  # a stream joins
    s.schedule()
    s.running = [_Req(0, 3000)]  # it ended
    s.schedule()
    assert s.seen == [2048, 2048, 128, 2048]


def test_the_streams_budget_never_exceeds_the_engines():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls)
    s = cls(max_num_scheduled_tokens=64)
    s.running = [_Req(0, 3000), _Req(40, 20)]
    s.schedule()
    assert s.seen == [64]


def test_the_step_cost_is_learned_from_decode_steps_and_prompt_steps():
    cost = StepCost(2000)
    assert cost.tokens(50, 0) is None  # nothing timed yet
    cost.observe(10, 0, 0)  # streams alone: the fixed cost
    cost.observe(20, 8, 0)  # too few prompt tokens to teach the per-token cost
    assert cost.tokens(50, 0) is None
    cost.observe(130, 256, 2000)  # 120 ms for 256 tokens at twice the cost of none
    assert cost.fixed_ms == 10 and abs(cost.unit_ms - 120 / 512) < 1e-9
    assert cost.tokens(50, 0) == 170 and cost.tokens(50, 2000) == 85
    assert cost.tokens(5, 0) == 0  # the fixed cost alone passes the target


def test_beside_streams_a_step_takes_what_fits_the_target_once_the_engine_has_timed_one():
    clock = iter([0.0, 0.015625, 1.0, 1.140625, 2.0])  # decode step 15.625 ms, 256 tokens 140.625
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50, clock=lambda: next(clock))
    s = cls()
    s.running = [_Req(3000, 3000)]  # one stream
    s.update_from_output(s.schedule(1), None)  # a decode step alone: 15.625 ms
    s.running.append(_Req(0, 3000))  # a prompt joins at no context
    assert s.update_from_output(s.schedule(257), None) == "outputs"  # untimed: 256 + 1, 140.625 ms
    s.running[1] = _Req(2000, 3000)  # deep into it
    s.schedule(1000)
    assert s.seen == [256, 256, 1 + 35]  # (50 - 15.6) ms / (125 / 256 ms * 2) a token; the stream
    assert len(s.updated) == 2


def test_a_new_target_holds_from_the_next_step_and_only_where_there_is_a_budget():
    clock = iter([0.0, 0.015625, 1.0, 1.140625, 2.0, 3.0])
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50, clock=lambda: next(clock))
    s = cls()
    s.running = [_Req(3000, 3000)]
    s.update_from_output(s.schedule(1), None)  # decode alone: 15.625 ms
    s.running.append(_Req(0, 3000))
    s.update_from_output(s.schedule(257), None)  # 256 prompt tokens: 125 ms beyond it
    s.running[1] = _Req(2000, 3000)
    assert set_target(s, 100) == 100.0  # the TBT SLO doubled
    s.schedule(1000)
    assert s.seen[-1] == 1 + 86  # (100 - 15.6) ms / (125 / 256 ms * 2) a token
    assert set_target(_Scheduler(), 100) is None  # no step budget installed: nothing to set
    with pytest.raises(ValueError):
        set_target(s, 0)


def test_the_engine_core_utility_sets_its_schedulers_target():
    cls = type("Sched", (_Scheduler,), {})
    install(2000, 256, cls, target_ms=50)
    core_cls = type("EngineCore", (), {})
    install_control(core_cls)
    core = core_cls()
    core.scheduler = cls()
    assert core.kvcluster_step_target(75.0) == 75.0
    assert core.scheduler._kvcluster_target_ms == 75.0
