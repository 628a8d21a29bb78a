"""`worker.step_budget`: while streams run, a step's tokens shrink with the context its prompt
chunk attends to; while none does, a step gets the engine's whole budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.step_budget import MIN_CHUNK, budget, install


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
class _Scheduler:
    max_num_scheduled_tokens: int = 2048
    running: list = field(default_factory=list)
    seen: list = field(default_factory=list)

    def schedule(self) -> int:
        self.seen.append(self.max_num_scheduled_tokens)
        return len(self.seen)


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
