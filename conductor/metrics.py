"""The conductor's Prometheus metrics (prometheus-client), on a registry of its own.

Per request: a few counter increments and histogram observations, and one observation per
streamed chunk. Per-instance load and the cache hit ratios are computed at scrape time.
Retries and fall-backs are counted by whoever performs them: `Metrics.retry(stage)` and
`Metrics.fallback(kind)`. The pool's transfer counters per instance come from the workers
(`conductor.pool_stats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conductor.pool_stats import PoolCollector
from conductor.timeline import STAGES, Timeline

log = structlog.get_logger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLIENT_CLOSED = "499"
"""The status label of a request whose client went away before the answer (nginx's code)."""

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015,
                  0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, instances: Callable[[], Iterable[Any]] = tuple,
                 pool: Callable[[], Mapping[str, Any]] = dict,
                 states: Callable[[], Iterable[tuple[str, str, str, str]]] = tuple) -> None:
        """`instances` returns the current instances' loads (`snapshot.InstanceLoad`s), `pool`
        each instance's latest `worker_pb2.PoolStats` (`PoolStatsPoller.latest`), `states`
        every instance's (id, role, state, why it is unhealthy)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvcluster_requests", "Requests answered, by endpoint and HTTP "
                                "status (499: the client went away).", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("kvcluster_time_to_first_token_seconds", "Arrival to the first "
                              "token, as the conductor sees it.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("kvcluster_inter_token_latency_seconds", "Time between output "
                             "tokens (TBT).", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvcluster_e2e_request_latency_seconds", "Arrival to the last "
                             "byte of the answer.", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvcluster_prompt_tokens", "Prompt tokens of the "
                                     "requests that got output.", registry=r)
        self.generation_tokens = Counter("kvcluster_generation_tokens", "Output tokens.",
                                         registry=r)
        self.cached_tokens = Counter("kvcluster_prompt_tokens_cached", "Prompt tokens the "
                                     "decode engine did not compute, by where their KV came "
                                     "from (local prefix cache, or the pool).", ["source"],
                                     registry=r)
        self.rejections = Counter("kvcluster_rejections", "Requests refused by the scheduler "
                                  "or for want of capacity (429, 503), by reason.", ["reason"],
                                  registry=r)
        self.retries_total = Counter("kvcluster_retries", "Worker calls retried, by stage.",
                                     ["stage"], registry=r)
        self.retries_refused = Counter("kvcluster_retries_refused", "Retries not made: the "
                                       "retry budget (--retry-budget) was spent.", registry=r)
        self.tenant_requests = Counter("kvcluster_tenant_requests", "Requests by tenant, "
                                       "priority class and outcome (admitted, or the reason "
                                       "they were refused: conductor/flow.py).",
                                       ["tenant", "priority", "outcome"], registry=r)
        self.tenant_in_flight = Gauge("kvcluster_tenant_in_flight", "A tenant's requests "
                                      "admitted and not finished.", ["tenant"], registry=r)
        self.tenant_tokens = Counter("kvcluster_tenant_tokens", "Tokens a tenant's finished "
                                     "requests used (prompt and output).", ["tenant"],
                                     registry=r)
        self.batch_queue = Gauge("kvcluster_batch_queue_depth", "Batch requests waiting for "
                                 "room.", registry=r)
        self.batch_wait = Histogram("kvcluster_batch_queue_wait_seconds", "How long batch "
                                    "requests waited for room before they were routed.",
                                    buckets=_STAGE_BUCKETS, registry=r)
        self.fallbacks_total = Counter("kvcluster_fallbacks", "Fall-backs taken (e.g. prefill "
                                       "on the decode instance, recompute), by kind.", ["kind"],
                                       registry=r)
        self.unhealthy_total = Counter("kvcluster_instance_unhealthy", "Instances taken out "
                                       "of routing by their health checks, by why (stalled: "
                                       "its engine held work and did not step; UNAVAILABLE, "
                                       "DEADLINE_EXCEEDED: no answer; NOT_SERVING: a drain).",
                                       ["why"], registry=r)
        self.migrations_total = Counter("kvcluster_stream_migrations", "Decode streams "
                                        "continued on another instance after theirs failed.",
                                        registry=r)
        self.stage = Histogram("kvcluster_stage_seconds", "Where requests' time goes, by "
                               "stage of the request timeline (conductor/timeline.py).",
                               ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        for name in STAGES:
            self.stage.labels(name)
        self.tracing = None
        """A `conductor.tracing.Tracing` when spans are exported."""
        self.totals = {"prompt": 0, "local": 0, "pool": 0}
        r.register(_ClusterCollector(instances, self.totals, states))
        r.register(PoolCollector(pool))

    def retry(self, stage: str) -> None:
        self.retries_total.labels(stage).inc()

    def retry_refused(self) -> None:
        self.retries_refused.inc()

    def fallback(self, kind: str) -> None:
        self.fallbacks_total.labels(kind).inc()

    def tenant_admitted(self, tenant: str, priority: str, in_flight: int) -> None:
        self.tenant_requests.labels(tenant, priority, "admitted").inc()
        self.tenant_in_flight.labels(tenant).set(in_flight)

    def tenant_rejected(self, tenant: str, priority: str, reason: str) -> None:
        self.tenant_requests.labels(tenant, priority, reason).inc()

    def tenant_released(self, tenant: str, in_flight: int, tokens: int) -> None:
        self.tenant_in_flight.labels(tenant).set(in_flight)
        self.tenant_tokens.labels(tenant).inc(tokens)

    def batch_queue_depth(self, depth: int) -> None:
        self.batch_queue.set(depth)

    def batch_waited(self, seconds: float) -> None:
        self.batch_wait.observe(seconds)

    def reject(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def cache_hit(self, prompt_tokens: int, cached_tokens: int, pool_tokens: int) -> None:
        pool = min(pool_tokens, cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.labels("pool").inc(pool)
        self.cached_tokens.labels("local").inc(cached_tokens - pool)
        self.totals["prompt"] += prompt_tokens
        self.totals["pool"] += pool
        self.totals["local"] += cached_tokens - pool

    def instance_unhealthy(self, why: str) -> None:
        self.unhealthy_total.labels(why).inc()

    def migration(self) -> None:
        self.migrations_total.inc()

    def timer(self, endpoint: str, parent: Any = None,
              arrived: float | None = None) -> RequestTimer:
        """`parent`: the caller's trace context, for the request's span; `arrived`: when the
        server first saw the request (wall clock, `conductor.arrival`), else now."""
        return RequestTimer(self, endpoint, parent, arrived)

    def timeline(self, tl: Timeline, status: int | str, parent: Any = None) -> None:
        """A finished request's timeline: the stage histogram, a log line, its spans."""
        stages = tl.stages()
        for name, seconds in stages.items():
            self.stage.labels(name).observe(seconds)
        log.info("timeline", status=status, **tl.attrs,
                 **{f"{k}_ms": round(v * 1e3, 3) for k, v in stages.items()})
        if self.tracing is not None:
            self.tracing.export(tl, status, parent)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's clock: arrival, first token, each next token, the end; and its
    timeline (`conductor.timeline`), finished with it.

    `hold()` keeps the timeline's sink (the stage histogram, the log line, the spans: ~0.3 ms)
    from running at `finish` until `release()`, so that a response can go out first; the
    response marks `answered` when its last bytes are handed to the server, then releases."""

    __slots__ = ("_m", "endpoint", "t0", "_last", "done", "on_finish", "timeline", "parent",
                 "_held", "_status")

    def __init__(self, metrics: Metrics, endpoint: str, parent: Any = None,
                 arrived: float | None = None) -> None:
        self._m = metrics
        self.endpoint = endpoint
        self.t0 = time.perf_counter()
        if arrived is not None:  # the histograms count from the arrival too
            self.t0 -= max(time.time() - arrived, 0.0)
        self._last = 0.0
        self.done = False
        self.on_finish: Callable[[], None] | None = None
        self.timeline = Timeline(arrived)
        self.parent = parent
        self._held = False
        self._status: int | str | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        self.timeline.mark("last_token")
        if not self._last:
            self._m.ttft.observe(now - self.t0)
            self.timeline.mark("first_token")
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self._m.itl.observe(gap)
        self._last = now
        self._m.generation_tokens.inc(n)

    def finish(self, status: int | str) -> None:
        """Count the request once, under its final status."""
        if self.done:
            return
        self.done = True
        if self.on_finish is not None:
            self.on_finish()
        self._m.requests.labels(self.endpoint, str(status)).inc()
        self._m.e2e.observe(time.perf_counter() - self.t0)
        self._status = status
        if not self._held:
            self.release()

    def hold(self) -> None:
        self._held = True

    def end(self, status: int | str) -> None:
        """`finish` and sink now, held or not (an error: no response goes out before it)."""
        self.finish(status)
        self.release()

    def answered(self) -> None:
        """The response's last bytes went to the server: mark it, and sink the timeline."""
        self.timeline.mark_once("answered")
        self.release()

    def release(self) -> None:
        """Sink the timeline if the request finished and it was not sunk yet."""
        self._held = False
        status, self._status = self._status, None
        if status is not None:
            self._m.timeline(self.timeline, status, self.parent)


class _ClusterCollector(Collector):
    """Per-instance load as the conductor counts it, and the cache hit ratios, at scrape."""

    def __init__(self, instances: Callable[[], Iterable[Any]], totals: dict[str, int],
                 states: Callable[[], Iterable[tuple[str, str, str, str]]] = tuple) -> None:
        self._instances = instances
        self._totals = totals
        self._states = states

    def collect(self) -> Iterable[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily("kvcluster_instance_in_flight", "Requests dispatched to "
                                      "the instance and not finished.",
                                      labels=["instance", "role"])
        queued = GaugeMetricFamily("kvcluster_instance_queued_prompt_tokens", "Prompt tokens "
                                   "of prefills dispatched to the instance and not finished "
                                   "(its queue depth).", labels=["instance", "role"])
        slowdown = GaugeMetricFamily(
            "kvcluster_instance_prefill_slowdown", "The instance's prefill times as the "
            "conductor prices them: over the fitted model's, alone and beside streams of its "
            "own.",
            labels=["instance", "role", "when"])
        for i in self._instances():
            in_flight.add_metric([i.instance_id, i.role], i.in_flight)
            queued.add_metric([i.instance_id, i.role], i.queued_prompt_tokens)
            for when, value in (("alone", i.speed(False)), ("beside", i.speed(True))):
                slowdown.add_metric([i.instance_id, i.role, when], value)
        yield in_flight
        yield queued
        yield slowdown
        state = GaugeMetricFamily("kvcluster_instance_state", "1 for every instance, labelled "
                                  "with its routing state (serving, unhealthy, draining, ...) "
                                  "and why it is unhealthy.",
                                  labels=["instance", "role", "state", "why"])
        for iid, role, name, why in self._states():
            state.add_metric([iid, role, name, why], 1)
        yield state
        ratio = GaugeMetricFamily("kvcluster_cache_hit_ratio", "Share of prompt tokens served "
                                  "from a cache since start, by source.", labels=["source"])
        total = self._totals["prompt"]
        for source in ("local", "pool"):
            ratio.add_metric([source], self._totals[source] / total if total else 0.0)
        yield ratio

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []
