"""A step budget for an engine whose prompts are prefilled between its streams' tokens: while
streams run, small and shrinking with the context the step's prompt chunk attends to, so that
a step takes about as long at the end of a long prompt as at its start; while none runs, the
engine's whole configured budget.

vLLM's budget (`max_num_batched_tokens`) is a token count fixed at start, but a token's cost
grows with the context it attends to. Measured with the bench-e2e model on one core
(2026-11-26, a 3,500-token prompt in 128-token steps): a step took 26 ms at the prompt's start
and 54 at 3,400 tokens in bfloat16 (62 and 142 in float32); fitted over 64-, 128- and 256-token
steps, `15 ms + k * (0.10 ms + 5.2e-5 ms * c)` for `k` tokens at context `c`: a token at 1,940
tokens of context costs twice one at none. So with `KVCLUSTER_STEP_CONTEXT_TOKENS=<h>` and
`KVCLUSTER_STEP_TOKENS=<b>` in an engine's environment (`cluster.shape.Engine.step_context`,
`step_tokens`), a step that carries a stream's token gets `b * h / (h + c)` tokens, `c` the
longest context a running prompt has reached, never fewer than its streams' plus `MIN_CHUNK`
(so no stream misses a step). A step with no stream to hold up gets the configured budget
(vLLM's, 2048 unless set): no one waits on its end but the requests queued behind the prompt,
which vLLM schedules only once the prompt's last chunk leaves budget over, so they wait for
the whole prefill either way, and fewer steps finish it sooner (each step costs its own
~15 ms, and a cold 2,000-token prompt takes 14 steps at the streams' budget)."""

from __future__ import annotations

MIN_CHUNK = 16
"""Prompt tokens a step may always carry beside its streams' (one per stream)."""


def budget(base: int, context: int, half_at: int, streams: int) -> int:
    """A step's tokens: `base` at no context, half of it at `half_at`; at least `streams`
    + `MIN_CHUNK`, at most `base`."""
    scaled = base * half_at // (half_at + max(context, 0))
    return min(base, max(scaled, streams + MIN_CHUNK))


def install(half_at: int, shared: int, scheduler_cls: type | None = None) -> None:
    """Every step of this process's vLLM scheduler (`scheduler_cls`, default vLLM's
    `Scheduler`) gets the budget for its running streams and prompts' context: `shared` (at
    most the configured budget) shrunk by the context while a stream runs, the configured one
    while none does (idempotent)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if getattr(scheduler_cls, "_kvcluster_step_context", None) is not None:
        return
    original = scheduler_cls.schedule

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        solo = self.__dict__.setdefault("_kvcluster_base_budget", self.max_num_scheduled_tokens)
        context, streams = 0, 0
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                context = max(context, r.num_computed_tokens)
            else:
                streams += 1
        self.max_num_scheduled_tokens = (
            budget(min(shared, solo), context, half_at, streams) if streams else solo)
        return original(self, *args, **kwargs)

    scheduler_cls.schedule = schedule
    scheduler_cls._kvcluster_step_context = half_at
