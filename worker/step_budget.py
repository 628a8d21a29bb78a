"""A step budget that shrinks with the context the step's prompt chunk attends to, so that a
step takes about as long at the end of a long prompt as at its start.

vLLM's budget (`max_num_batched_tokens`) is a token count fixed at start, but a token's cost
grows with the context it attends to. Measured with the bench-e2e model on one core
(2026-11-26, a 3,500-token prompt in 128-token steps): a step took 26 ms at the prompt's start
and 54 at 3,400 tokens in bfloat16 (62 and 142 in float32); fitted over 64-, 128- and 256-token
steps, `15 ms + k * (0.10 ms + 5.2e-5 ms * c)` for `k` tokens at context `c`: a token at 1,940
tokens of context costs twice one at none. So with `KVCLUSTER_STEP_CONTEXT_TOKENS=<h>` in an
engine's environment (`cluster.shape.Engine.step_context`), each step's budget is the
configured one times `h / (h + c)`, `c` the longest context a running prompt has reached; and
never below the running streams' tokens plus `MIN_CHUNK`, so no stream misses a step."""

from __future__ import annotations

MIN_CHUNK = 16
"""Prompt tokens a step may always carry beside its streams' (one per stream)."""


def budget(base: int, context: int, half_at: int, streams: int) -> int:
    """A step's tokens: `base` at no context, half of it at `half_at`; at least `streams`
    + `MIN_CHUNK`, at most `base`."""
    scaled = base * half_at // (half_at + max(context, 0))
    return min(base, max(scaled, streams + MIN_CHUNK))


def install(half_at: int, scheduler_cls: type | None = None) -> None:
    """Every step of this process's vLLM scheduler (`scheduler_cls`, default vLLM's
    `Scheduler`) gets the budget for its running prompts' context (idempotent)."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    if getattr(scheduler_cls, "_kvcluster_step_context", None) is not None:
        return
    original = scheduler_cls.schedule

    def schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        base = self.__dict__.setdefault("_kvcluster_base_budget", self.max_num_scheduled_tokens)
        context, streams = 0, 0
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                context = max(context, r.num_computed_tokens)
            else:
                streams += 1
        self.max_num_scheduled_tokens = budget(base, context, half_at, streams)
        return original(self, *args, **kwargs)

    scheduler_cls.schedule = schedule
    scheduler_cls._kvcluster_step_context = half_at
