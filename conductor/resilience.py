"""What a request does when an instance fails it: the decisions, apart from the calls.

A failure of the request itself (the worker refused it: a 4xx) is its answer and never
retried. A failure of an instance is survived where something else can run the request:

- a prefill failing before the decode's first token: the prefill is retried on another
  prefill-capable instance, or, with none left, the decode instance computes the prompt
  itself (`fallback_prefill_on_decode`);
- a decode failing before its first token: retried on another instance;
- a stream broken after it: continued on another decode instance from the prompt plus the
  tokens already sent (their KV is in the pool, so it recomputes little), up to
  `MAX_MIGRATIONS` times;
- a failure after choice 0 finished loses nothing and is ignored;
- a decode whose first token is not the one the prefill streamed (`Diverged`: it was
  released without it, after its hold timed out) is no failure of the instance: the stream
  continues from what was sent, on any decode instance (that one included), like a
  migration.

Every retry and migration takes from the conductor's retry budget (a share of recent
requests, `--retry-budget`: failures never multiply the load), except those of calls the
conductor cancelled because their instance was found lost (`lost`: each moves once, off an
instance no longer routed to, however many it held), and waits a jittered, doubling
backoff; a failed instance counts towards its circuit breaker (the mechanisms, shared with
the pool and membership: `cluster/resilience.py`). The same engine error from a second instance
is the request's own: it is the answer, and the second instance's breaker does not count it.
When nothing else can run the request, or the budget is spent, the latest failure is the
answer. Each path counts in the request's `Outcome` and the metrics,
and logs a marker (`retry`, `fallback_prefill_on_decode`, `stream_migrated`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import grpc
import structlog

from cluster.resilience import Backoff, RetryBudget
from conductor.errors import ConductorError, Timeout, UpstreamFailed, from_worker_status
from protos import worker_pb2
from store.block_hash import extend_hashes

if TYPE_CHECKING:
    from conductor.pipeline import Delta, Outcome, Prepared

log = structlog.get_logger(__name__)

MAX_RETRIES = 2
"""Retries per request (prefill elsewhere, decode before its first token elsewhere)."""
MAX_MIGRATIONS = 2
"""Times one stream may move to another decode instance."""
BACKOFF_S = 0.05
"""First retry's backoff; doubled per retry, capped at 1 s, jittered by ±50%."""
_BACKOFF = Backoff(BACKOFF_S, 1.0, jitter=0.5)

RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})
"""Failures of the instance, not of the request (CANCELLED: its channel was closed as it
left the cluster; our own cancellations arrive as CancelledError instead)."""
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
"""Failures that open the instance's breaker at once."""


class WorkerFailure(Exception):
    """A worker call failed; `error` is what the client gets if nothing else works."""

    def __init__(self, instance: str, code: grpc.StatusCode, error: ConductorError,
                 details: str = "") -> None:
        super().__init__(error.message)
        self.instance = instance
        self.code = code
        self.error = error
        self.retryable = code in RETRYABLE
        self.details = details
        """What the worker said (its gRPC status details); empty: the conductor's own."""
        self.evacuated = False
        """The conductor cancelled the call: its instance was found lost (`lost`)."""


class PrefillFailure(WorkerFailure):
    """The prefill running beside a decode failed before the decode's first token."""

    @classmethod
    def of(cls, f: WorkerFailure) -> PrefillFailure:
        return cls(f.instance, f.code, f.error, f.details)


class ResilienceMetrics(Protocol):
    """Where the failure paths taken are counted (`conductor.metrics.Metrics`)."""

    def retry(self, stage: str) -> None: ...
    def retry_refused(self) -> None: ...
    def fallback(self, kind: str) -> None: ...
    def migration(self) -> None: ...


ENGINE_ERRORS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
"""Failures a worker reports of its engine (not of its transport): the same one from two
instances is the request's own (`Recovery.repeats`)."""


def rpc_failure(e: grpc.aio.AioRpcError, instance: str, stage: str) -> WorkerFailure:
    log.warning("worker_rpc_failed", instance=instance, stage=stage, code=e.code().name,
                details=e.details())
    return WorkerFailure(instance, e.code(), from_worker_status(
        e.code(), f"{stage} on {instance}: {e.details()}"), e.details() or "")


def stalled(instance: str, seconds: float) -> WorkerFailure:
    """A decode stream sent nothing for `seconds` (`ConductorConfig.stall_timeout_s`)."""
    log.warning("decode_stalled", instance=instance, seconds=round(seconds, 3))
    return WorkerFailure(instance, grpc.StatusCode.DEADLINE_EXCEEDED, Timeout(
        f"decode on {instance}: no token for {seconds:.1f}s", code="decode_stalled"))


def left(instance: str, stage: str) -> WorkerFailure:
    """The instance's channel closed under the call: it left the cluster."""
    log.warning("worker_rpc_failed", instance=instance, stage=stage, code="CANCELLED",
                details="channel closed: the instance left the cluster")
    return WorkerFailure(instance, grpc.StatusCode.CANCELLED, UpstreamFailed(
        f"{stage} on {instance}: the instance left the cluster"))


def lost(instance: str, stage: str, why: str = "") -> WorkerFailure:
    """The health checker cancelled the call: the instance stopped answering, or its engine
    stalled (`why`, `Registry.set_unhealthy(lost=True)`)."""
    what = "its engine stalled" if why == "stalled" else "the instance stopped answering"
    log.warning("worker_rpc_failed", instance=instance, stage=stage, code="UNAVAILABLE",
                details=f"cancelled: {what} ({why or 'health checks'})")
    f = WorkerFailure(instance, grpc.StatusCode.UNAVAILABLE, UpstreamFailed(
        f"{stage} on {instance}: {what}"))
    f.evacuated = True
    return f


def cancelled_by_us() -> bool:
    """A CancelledError out of a worker call is ours (the client went away) when this task is
    being cancelled; otherwise grpc.aio cancelled the call itself because the channel to an
    instance that left the cluster closed under it (no AioRpcError then)."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


class Diverged(WorkerFailure):
    """The decode's first token differs from the prefill's, already streamed."""

    def __init__(self, instance: str, message: str) -> None:
        super().__init__(instance, grpc.StatusCode.ABORTED, UpstreamFailed(message))


class Next(enum.Enum):
    RETRY = "retry"
    """Route again, avoiding the failed instance."""
    FALLBACK = "fallback"
    """Run on the decode instance alone: it computes the prompt."""
    MIGRATE = "migrate"
    """Continue the broken stream elsewhere (`Recovery.current`)."""
    DONE = "done"
    """Nothing was lost: end the request normally."""


@dataclass
class Recovery:
    """One request's failures so far, and what they allow next."""

    prep: Prepared
    outcome: Outcome
    metrics: ResilienceMetrics | None = None
    budget: RetryBudget | None = None
    """The conductor's retry budget: retries and migrations take from it (None: no limit
    but the request's own)."""
    exclude: set[str] = field(default_factory=set)
    """Instances that failed this request."""
    sent: list[int] = field(default_factory=list)
    """Choice 0's tokens streamed so far."""
    done: bool = False
    """Choice 0 finished: a failure after that loses nothing."""
    last: WorkerFailure | None = None
    """The latest failure: the answer when nothing else can run the request."""
    broken: WorkerFailure | None = None
    """The failure the next route continues from (a migration under way)."""
    current: Prepared | None = None
    """The request to run next: `prep`, or its continuation after a broken stream."""

    def __post_init__(self) -> None:
        self.current = self.prep

    def streamed(self, delta: Delta) -> None:
        if delta.index == 0:
            self.sent.extend(delta.token_ids)
            self.done = self.done or delta.finish_reason is not None

    def decide(self, f: WorkerFailure, other_prefill: bool) -> Next:
        """What to do after `f` (already counted against its instance); raises the failure's
        error when it is the answer."""
        if not f.retryable:
            raise f.error
        o = self.outcome
        if isinstance(f, Diverged) and o.migrations < MAX_MIGRATIONS and _continuable(
                self.prep):
            return self._migrate(f)
        if self.repeats(f):
            log.warning("request_failed_alike", request_id=self.prep.request_id,
                        failed=[self.last.instance, f.instance], error=f.code.name)
            raise f.error
        self.exclude.add(f.instance)
        self.last = f
        if isinstance(f, PrefillFailure):
            if other_prefill and o.retries < MAX_RETRIES and self._budget_allows(f):
                return self._retry("prefill", f)
            o.fallbacks.append("prefill_on_decode")
            if self.metrics is not None:
                self.metrics.fallback("prefill_on_decode")
            log.warning("fallback_prefill_on_decode", request_id=self.prep.request_id,
                        failed=f.instance)
            return Next.FALLBACK
        if self.done and (self.prep.params.n or 1) == 1:
            return Next.DONE
        if not self.sent and o.retries < MAX_RETRIES:
            if not self._budget_allows(f):
                raise f.error
            return self._retry("decode", f)
        if self.sent and o.migrations < MAX_MIGRATIONS and _continuable(self.prep):
            return self._migrate(f)
        raise f.error

    def repeats(self, f: WorkerFailure) -> bool:
        """`f` is the engine error the previous instance gave too: the request's own failure,
        not the instances' (it is not retried again, nor counted against the instance)."""
        last = self.last
        return (last is not None and f.code in ENGINE_ERRORS and bool(f.details)
                and f.instance != last.instance and (f.code, f.details) == (last.code,
                                                                            last.details))

    def _budget_allows(self, f: WorkerFailure) -> bool:
        """Take a retry from the budget (True), or count the refusal (False); a call moved
        off a lost instance takes none."""
        if f.evacuated or self.budget is None or self.budget.try_retry():
            return True
        if self.metrics is not None:
            self.metrics.retry_refused()
        log.warning("retry_budget_spent", request_id=self.prep.request_id,
                    failed=f.instance, error=f.code.name)
        return False

    def _migrate(self, f: WorkerFailure) -> Next:
        if not self._budget_allows(f):
            raise f.error
        self.current = _continued(self.prep, self.sent, self.outcome.migrations + 1)
        self.broken = f
        return Next.MIGRATE

    def no_route(self, err: ConductorError) -> None:
        """Routing found nowhere to go: after a failure, that failure is the answer."""
        if self.last is not None:
            raise self.last.error from None
        raise err

    def routed(self, decode: str) -> None:
        """A new route was taken; if a stream was broken, it migrates there."""
        if self.broken is None:
            return
        self.outcome.migrations += 1
        if self.metrics is not None:
            self.metrics.migration()
        log.warning("stream_migrated", request_id=self.prep.request_id,
                    failed=self.broken.instance, to=decode, tokens_sent=len(self.sent),
                    error=self.broken.code.name)
        self.broken = None

    def _retry(self, stage: str, f: WorkerFailure) -> Next:
        o = self.outcome
        if self.metrics is not None:
            self.metrics.retry(stage)
        o.retries += 1
        o.retried.append(stage)
        log.warning("retry", request_id=self.prep.request_id, stage=stage, failed=f.instance,
                    error=f.code.name, attempt=o.retries)
        return Next.RETRY

    async def backoff(self) -> None:
        await asyncio.sleep(_BACKOFF.nth(self.outcome.retries))


def _continuable(prep: Prepared) -> bool:
    """A broken stream can go on elsewhere: one choice, no prompt logprobs to resend."""
    p = prep.params
    return (p.n or 1) == 1 and not p.HasField("prompt_logprobs")


def _continued(prep: Prepared, sent: list[int], n: int) -> Prepared:
    """The rest of a broken stream as a request of its own: the prompt and the tokens
    already sent, for the tokens still owed."""
    p = worker_pb2.SamplingParams()
    p.CopyFrom(prep.params)
    p.max_tokens = prep.params.max_tokens - len(sent)
    p.min_tokens = max(prep.params.min_tokens - len(sent), 0)
    tokens = prep.token_ids + sent
    return replace(prep, request_id=f"{prep.request_id}-m{n}", token_ids=tokens,
                   max_tokens=p.max_tokens, params=p,
                   block_hashes=prep.block_hashes + tuple(extend_hashes(
                       prep.block_hashes[-1] if prep.block_hashes else None,
                       prep.token_ids[len(prep.block_hashes) * prep.block_size:] + sent,
                       prep.block_size, prep.cache_salt)))
