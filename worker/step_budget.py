"""A step budget for an engine whose prompts are prefilled between its streams' tokens: while
streams run, as many prompt tokens as fit a target step time, fewer as the context the step's
prompt chunk attends to grows; while none runs, the engine's whole configured budget.

vLLM's budget (`max_num_batched_tokens`) is a token count fixed at start, but a step's time
is not: it grows with the context a prompt token attends to (on a CPU a token at ~2,000
tokens of context costs about twice one at none), and differs by an order of magnitude
between machines (with AMX or without), so a token count that holds the TBT SLO on one
machine breaks it on another. So the budget is set in time, and each engine learns its own
cost (`StepCost`: a fixed cost per step plus a cost per prompt token growing linearly with
its context; docs/design.md, "Steps on a CPU engine", has the measured fit).

With `KVCLUSTER_STEP_CONTEXT_TOKENS=<h>`, `KVCLUSTER_STEP_TOKENS=<b>` and
`KVCLUSTER_STEP_MS=<t>` in an engine's environment (`cluster.shape.Engine.step_context`,
`step_tokens`, and `cluster.shape.step_target_ms`: half the TBT SLO the conductor was started
with; a live change, `conductorctl slo`, does not reach it), a step that carries a stream's
token gets the prompt tokens that its engine's own steps say take `t` ms at context `c` (the
longest a running prompt has reached), never fewer than its streams' plus `MIN_CHUNK` (so no stream
misses a step) nor more than the engine's budget; until its first prompt step has been
timed, `b * h / (h + c)`. A step with no stream to hold up gets the configured budget
(vLLM's, 2048 unless set): no one waits on its end but the requests queued behind the
prompt, which vLLM schedules only once the prompt's last chunk leaves budget over, so they
wait for the whole prefill either way, and fewer steps finish it sooner (each step costs its
own fixed time, and a cold 2,000-token prompt takes 14 steps at 128-256 tokens).

A step that finishes a prompt carries no other prompt's chunk (`finish_first`): on CPU a step's
time grows with every token it carries, so a chunk packed beside the last one of a prompt only
delays that prompt's first token, and the packed prompt, unfinished, is no sooner done. vLLM
fills whatever budget a finishing prompt leaves, so a cold prompt's last couple of hundred
tokens would share a 2,048-token step with the next prompt's and take five times as long
(docs/design.md, "The step that finishes a prompt carries no other prompt's chunk"). A waiting
prompt still joins such a step when its tokens cost less than a step's fixed cost
(`StepCost.rides_along`): a second step would cost it more."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MIN_CHUNK = 16
"""Prompt tokens a step may always carry beside its streams' (one per stream)."""
LEARN_RATE = 0.2
"""Weight of the newest step in `StepCost`'s running averages."""
TARGET_ATTR = "_kvcluster_target_ms"
"""A scheduler's step target once it has been set while serving (`set_target`)."""
MIN_TIMED_TOKENS = 32
"""Prompt tokens a step needs for its time to teach the per-token cost (below, its fixed
cost dominates and its noise would)."""


def budget(base: int, context: int, half_at: int, streams: int) -> int:
    """A step's tokens: `base` at no context, half of it at `half_at`; at least `streams`
    + `MIN_CHUNK`, at most `base`."""
    return _bounded(base * half_at // (half_at + max(context, 0)), streams, base)


def _bounded(tokens: int, streams: int, cap: int) -> int:
    """`tokens` for a step, but at least every stream's and `MIN_CHUNK`, at most `cap`."""
    return min(cap, max(tokens, streams + MIN_CHUNK))


def _average(old: float | None, new: float) -> float:
    """The running average `old` (None: none yet) moved toward `new` by `LEARN_RATE`."""
    return new if old is None else old + LEARN_RATE * (new - old)


class StepCost:
    """An engine's step time, learned from its own steps: `fixed_ms` (a step of streams' tokens
    alone) plus `unit_ms * (1 + c / half_at)` per prompt token at context `c`, each a running
    average (`LEARN_RATE`)."""

    def __init__(self, half_at: int) -> None:
        self.half_at = half_at
        self.fixed_ms: float | None = None
        self.unit_ms: float | None = None

    def _weight(self, context: int) -> float:
        return 1 + max(context, 0) / self.half_at

    def observe(self, ms: float, prompt_tokens: int, context: int) -> None:
        """One step that took `ms` and carried `prompt_tokens` prompt tokens at `context`."""
        if prompt_tokens <= 0:
            self.fixed_ms = _average(self.fixed_ms, ms)
        elif prompt_tokens >= MIN_TIMED_TOKENS:
            unit = max(ms - (self.fixed_ms or 0.0), 0.0) / (prompt_tokens * self._weight(context))
            self.unit_ms = _average(self.unit_ms, unit)

    def rides_along(self, tokens: int) -> bool:
        """Whether `tokens` prompt tokens cost a step less than its fixed cost (at most
        `MIN_CHUNK` before both are learned)."""
        if self.unit_ms and self.fixed_ms:
            return tokens * self.unit_ms <= self.fixed_ms
        return tokens <= MIN_CHUNK

    def tokens(self, target_ms: float, context: int) -> int | None:
        """Prompt tokens a step at `context` can carry in `target_ms` (None: not learned)."""
        if not self.unit_ms:
            return None
        spare = target_ms - (self.fixed_ms or 0.0)
        return max(int(spare / (self.unit_ms * self._weight(context))), 0)


def install(half_at: int, shared: int, scheduler_cls: type | None = None,
            target_ms: float = 0.0, clock=time.monotonic,  # type: ignore[no-untyped-def]
            finish: bool = True) -> None:
    """Every step of this process's vLLM scheduler (`scheduler_cls`, default vLLM's
    `Scheduler`) gets the budget for its running streams and prompts' context: while a
    stream runs, what fits `target_ms` by the engine's learned `StepCost` (before it has
    learned, or with no target, `shared` shrunk by the context), at most the configured
    budget; while none runs, the configured one; and, with `finish`, `finish_first`
    (idempotent; `clock`: seconds)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if getattr(scheduler_cls, "_kvcluster_step_context", None) is not None:
        return
    original, update = scheduler_cls.schedule, scheduler_cls.update_from_output

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        solo = self.__dict__.setdefault("_kvcluster_base_budget", self.max_num_scheduled_tokens)
        cost = self.__dict__.setdefault("_kvcluster_step_cost", StepCost(half_at))
        context, streams = 0, 0
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                context = max(context, r.num_computed_tokens)
            else:
                streams += 1
        target = self.__dict__.get(TARGET_ATTR, target_ms)
        learned = cost.tokens(target, context) if streams and target else None
        if not streams:
            self.max_num_scheduled_tokens = solo
        elif learned is None:
            self.max_num_scheduled_tokens = budget(min(shared, solo), context, half_at, streams)
        else:
            self.max_num_scheduled_tokens = _bounded(streams + learned, streams, solo)
        if finish:
            with finish_first(self, streams, cost):
                out = original(self, *args, **kwargs)
        else:
            out = original(self, *args, **kwargs)
        if out.total_num_scheduled_tokens:
            pending = self.__dict__.setdefault("_kvcluster_pending", {})
            if len(pending) > 8:  # outputs never updated (not vLLM's way): forget them
                pending.clear()
            pending[id(out)] = (
                clock(), out.total_num_scheduled_tokens - streams, context)
        return out

    def update_from_output(self, scheduler_output, *args, **kwargs):  # type: ignore[no-untyped-def]
        started = self.__dict__.get("_kvcluster_pending", {}).pop(id(scheduler_output), None)
        if started is not None:
            start, prompt_tokens, context = started
            self._kvcluster_step_cost.observe(
                (clock() - start) * 1e3, prompt_tokens, context)
        return update(self, scheduler_output, *args, **kwargs)

    scheduler_cls.schedule = schedule
    scheduler_cls.update_from_output = update_from_output
    scheduler_cls._kvcluster_step_context = half_at


@contextmanager
def finish_first(scheduler: Any, streams: int, cost: StepCost) -> Iterator[None]:
    """While `scheduler` (vLLM's) schedules one step: the budget ends where its first prompt in
    progress does (that prompt's remaining tokens beside the streams' one each, or
    `MIN_CHUNK`), and once a waiting prompt has been admitted (with budget left, it finishes
    in this step) only prompts that `cost.rides_along` follow it. vLLM schedules its running
    requests in order, then takes waiting ones while budget is left and their queue is
    non-empty: that test is answered here, by a view of each queue."""
    budget = scheduler.max_num_scheduled_tokens
    for r in scheduler.running:
        if r.num_computed_tokens < r.num_prompt_tokens:
            left = getattr(r, "num_tokens", r.num_prompt_tokens) - r.num_computed_tokens
            scheduler.max_num_scheduled_tokens = min(budget, streams + max(left, MIN_CHUNK))
            break
    names = [n for n in ("waiting", "kv_holding_waiting") if hasattr(scheduler, n)]
    queues = {n: getattr(scheduler, n) for n in names}
    admitted_after = len(scheduler.running)
    for n, q in queues.items():
        setattr(scheduler, n, _Gated(q, scheduler.running, admitted_after, cost))
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens = budget
        for n, q in queues.items():
            setattr(scheduler, n, q)


def install_finish_first(scheduler_cls: type | None = None) -> None:
    """`finish_first` alone, for every step of an engine with no step budget (a CPU prefill
    engine: its steps carry no streams; idempotent)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if getattr(scheduler_cls, "_kvcluster_step_context", None) is not None or getattr(
            scheduler_cls, "_kvcluster_finish_first", False):
        return
    original = scheduler_cls.schedule
    cost = StepCost(1)  # never learned: prompts of `MIN_CHUNK` tokens ride along

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        streams = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        with finish_first(self, streams, cost):
            return original(self, *args, **kwargs)

    scheduler_cls.schedule = schedule
    scheduler_cls._kvcluster_finish_first = True


class _Gated:
    """A waiting queue as one step's scheduling sees it: empty once a prompt has been admitted
    in this step (`running` grew past `admitted_after`), unless its head rides along."""

    def __init__(self, queue: Any, running: list, admitted_after: int, cost: StepCost) -> None:
        self._queue, self._running, self._after, self._cost = queue, running, admitted_after, cost

    def __bool__(self) -> bool:
        if not self._queue:
            return False
        if len(self._running) <= self._after:
            return True
        head = self._queue.peek_request()
        return self._cost.rides_along(head.num_tokens - head.num_computed_tokens)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._queue)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def set_target(scheduler: object, target_ms: float) -> float | None:
    """A new step target for `scheduler`'s steps beside streams, from its next step on (the
    conductor's TBT SLO changed); None, and nothing changed, where it has no step budget."""
    if getattr(type(scheduler), "_kvcluster_step_context", None) is None:
        return None
    if not target_ms > 0:
        raise ValueError(f"a step target must be positive, got {target_ms}")
    scheduler.__dict__[TARGET_ATTR] = float(target_ms)
    return float(target_ms)


def install_control(engine_core_cls: type | None = None) -> None:
    """`EngineCore.kvcluster_step_target(ms)`, a utility its front end calls
    (`AsyncLLM.engine_core.call_utility_async`): `set_target` on the engine's scheduler, run
    by the engine core between steps (idempotent)."""
    if engine_core_cls is None:
        from vllm.v1.engine.core import EngineCore as engine_core_cls

    def kvcluster_step_target(self, target_ms: float) -> float | None:  # type: ignore[no-untyped-def]
        return set_target(self.scheduler, target_ms)

    engine_core_cls.kvcluster_step_target = kvcluster_step_target
