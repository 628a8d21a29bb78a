"""The instances the conductor can route to: membership from etcd, one gRPC client each, and
the load counted at dispatch time (`scheduler.load.LoadState`). `snapshot()` freezes it for
the routing policy; listeners (the router) hear joins and leaves.

An etcd entry is only a claim: its instance is routed, and counts towards the cluster's terms
and parameters (`terms`: block size, context, namespace; its cores in the snapshot), only once
the worker at its address proved itself (`set_verified`, from `conductor.health`) and agrees
with the terms (`conductor.terms`); one that proved itself but disagrees is `mismatched`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import structlog

from cluster import keepalive
from cluster.instance import InstanceInfo, cpu_list
from cluster.plane_tls import PlaneTLS, aio_channel
from cluster.resilience import Breaker
from cluster.secret import ClusterSecret, bind
from conductor.calls import close_channel_later
from conductor.scheduler.load import LoadState
from conductor.scheduler.snapshot import ClusterSnapshot, InstanceLoad, SchedulerParams
from conductor.terms import Expected, Terms, agree
from protos import worker_pb2_grpc

log = structlog.get_logger(__name__)

BREAKER_THRESHOLD = 3
"""Failed worker calls in a row that open an instance's circuit breaker."""
LEFT_GRACE_S = 60.0
"""How long RPCs in flight to an instance that left membership may still run."""


@dataclass
class Instance:
    info: InstanceInfo
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    load: LoadState
    draining: bool = False
    """Taken out of routing by an operator (Drain) or a shrinking pool; requests in flight
    go on."""
    unhealthy: bool = False
    """Its health service did not answer SERVING at the last check: not routed to."""
    breaker: Breaker = field(default_factory=lambda: Breaker(2.0, BREAKER_THRESHOLD))
    """Counts worker calls failed in a row (transport or server errors, not the caller's);
    open: not routed to until its cool-down ends; then half-open: routed one request, the
    probe, whose first answer closes it and whose failure opens it again."""
    verified: bool = False
    """The worker at its address proved itself (`conductor.health`: it reports this very
    registration, with the cluster secret's proof when the cluster has one); not routed to
    until then."""
    proved: int = 0
    """The order in which it proved itself (`conductor.terms` keeps to it)."""
    mismatch: str = ""
    """Why it is left out though verified: it disagrees with the cluster's terms
    (`conductor.terms`); "": it agrees (or is not verified yet)."""
    welcomed: bool = False
    """It was admitted once (listeners heard `instance_admitted`)."""
    calls: set[grpc.aio.Call] = field(default_factory=set)
    """Its prefill and decode calls in flight: cancelled when it is found lost
    (`Registry.set_unhealthy`), so that their requests move on at once."""
    lost: bool = False
    """Unhealthy because it did not answer at all (unreachable, or silent: a stopped
    process) or its engine is stalled, not because it said NOT_SERVING (a graceful drain,
    whose calls go on)."""
    why: str = ""
    """Why it is unhealthy (`conductor.health`: stalled, NOT_SERVING, UNAVAILABLE, ...);
    "": it is not."""

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> str:
        """The role it is routed as: its registered one, or what a "both" instance was
        switched to."""
        return self.load.role

    @property
    def routable(self) -> bool:
        return (not self.draining and not self.unhealthy and self.breaker.admits()
                and self.admitted)

    @property
    def admitted(self) -> bool:
        """Verified and agreeing with the cluster's terms: it gives the cluster's
        parameters."""
        return self.verified and not self.mismatch

    @property
    def state(self) -> str:
        return ("unverified" if not self.verified else "mismatched" if self.mismatch
                else "unhealthy" if self.unhealthy else "draining" if self.draining
                else "broken" if self.breaker.open
                else "probing" if self.breaker.prober is not None else "serving")


class RegistryListener(Protocol):
    def instance_joined(self, inst: Instance) -> None: ...
    def instance_left(self, inst: Instance) -> None: ...
    def instance_admitted(self, inst: Instance) -> None:
        """It proved itself and agrees with the cluster's terms (once per instance): what
        it says may now shape the cluster's state."""


class PerInstance:
    """A registry listener running one asyncio task per instance (`_run`): started as the
    instance joins, cancelled as it leaves, all cancelled by `close`."""

    task_name = "per-instance"

    def __init__(self, registry: Registry) -> None:
        self._tasks: dict[str, asyncio.Task] = {}
        registry.listen(self)

    def instance_joined(self, inst: Instance) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: the registry is offline
            self._tasks[inst.instance_id] = asyncio.get_running_loop().create_task(
                self._run(inst), name=f"{self.task_name}-{inst.instance_id}")

    def instance_left(self, inst: Instance) -> None:
        task = self._tasks.pop(inst.instance_id, None)
        if task is not None:
            task.cancel()

    def instance_admitted(self, inst: Instance) -> None:
        pass

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, inst: Instance) -> None:
        raise NotImplementedError


class Registry:
    def __init__(self, secret: ClusterSecret | None = None, tls: PlaneTLS | None = None,
                 expected: Expected | None = None) -> None:
        self.secret = secret
        """The cluster secret: every worker stub carries its instance's token."""
        self.expected = expected or Expected()
        """What the conductor's configuration fixes of the cluster's terms."""
        self.terms = Terms(block_size=self.expected.block_size)
        """The terms in force and the parameters the admitted instances give
        (`conductor.terms`)."""
        self.on_terms: list[Callable[[Terms], None]] = []
        """Told of every change of `terms`."""
        self.on_unhealthy: list[Callable[[str], None]] = []
        """Told why, each time an instance turns unhealthy."""
        self._proofs = itertools.count(1)
        self.tls = tls
        """The worker plane's TLS (`cluster.plane_tls`): None, plaintext channels."""
        self._instances: dict[str, Instance] = {}
        self._listeners: list[RegistryListener] = []
        self._snap: ClusterSnapshot | None = None
        """The last snapshot, patched with the loads changed since (`_dirty`); None: rebuild."""
        self._dirty: set[str] = set()
        self._next_close = float("inf")
        """The earliest end of an open breaker's cool-down."""

    def listen(self, listener: RegistryListener) -> None:
        """Tell `listener` of every instance now and of joins and leaves from now on."""
        self._listeners.append(listener)
        for inst in self._instances.values():
            listener.instance_joined(inst)
            if inst.welcomed:
                listener.instance_admitted(inst)

    def sync(self, members: dict[str, InstanceInfo]) -> None:
        """Follow membership: open clients for joiners, close those of leavers. A registration
        that changed is a new instance, to be verified again."""
        for iid in list(self._instances):
            if members.get(iid) != self._instances[iid].info:
                self._leave(iid)
        for iid, info in members.items():
            if iid not in self._instances:
                channel = aio_channel(info.address, self.tls, keepalive.CLIENT)
                load = LoadState(iid, info.role, info.block_size, info.capacity_tokens,
                                 info.max_seqs)
                load.host, load.threads, load.side = info.host, info.threads, info.side
                stub = worker_pb2_grpc.WorkerStub(channel)
                if self.secret is not None:
                    stub = bind(stub, self.secret.metadata(info.address))
                inst = Instance(info, channel, stub, load)
                inst.load.on_change = self._dirty.add
                self._instances[iid] = inst
                self._snap = None
                log.info("instance_joined", instance_id=iid, role=info.role, address=info.address)
                for listener in self._listeners:
                    listener.instance_joined(inst)

    def _leave(self, iid: str) -> Instance:
        inst = self._instances.pop(iid)
        inst.load.on_change = None
        self._snap = None
        log.info("instance_left", instance_id=iid, role=inst.info.role)
        for listener in self._listeners:
            listener.instance_left(inst)
        if inst.verified:
            self._agree()
        # Its requests in flight go on: an instance whose lease lapsed may well be alive (a
        # starved machine), and a dead one fails them by itself (connection reset). The channel
        # closes once they ended, or cancels them after LEFT_GRACE_S (the pipeline then
        # retries or migrates them).
        close_channel_later(inst.channel, LEFT_GRACE_S)
        return inst

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        self._cool_down()
        return list(self._instances.values())

    def _cool_down(self) -> None:
        """Half-open the breakers whose cool-down is over (lazily, on every read of the
        instances' states: an instance must not stay "broken" for want of traffic)."""
        clock = time.monotonic()
        if self._next_close <= clock:
            self._half_open(clock)

    def set_draining(self, instance_id: str, draining: bool) -> Instance | None:
        """Take an instance out of routing (or back in); its requests in flight go on."""
        inst = self._instances.get(instance_id)
        if inst is not None and inst.draining != draining:
            inst.draining = draining
            self._snap = None
            log.info("instance_draining" if draining else "instance_undrained",
                     instance_id=instance_id)
        return inst

    def set_unhealthy(self, instance_id: str, unhealthy: bool, why: str = "",
                      lost: bool = False) -> None:
        """`lost`: it did not answer at all: its calls in flight are cancelled (they fail as
        the instance's, and their requests retry or migrate), not left to their deadlines."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        if inst.unhealthy != unhealthy:
            inst.unhealthy = unhealthy
            self._snap = None
            if unhealthy:
                log.warning("instance_unhealthy", instance_id=instance_id, why=why)
                for listener in self.on_unhealthy:
                    listener(why)
            else:
                log.info("instance_healthy", instance_id=instance_id)
        inst.lost = unhealthy and lost
        inst.why = why if unhealthy else ""
        if inst.lost and inst.calls:
            log.warning("instance_lost_calls_cancelled", instance_id=instance_id, why=why,
                        calls=len(inst.calls))
            for call in list(inst.calls):
                call.cancel()

    def set_verified(self, instance_id: str) -> None:
        """The worker at the instance's address proved itself: routable from now on if it
        agrees with the cluster's terms."""
        inst = self._instances.get(instance_id)
        if inst is not None and not inst.verified:
            inst.verified, inst.proved = True, next(self._proofs)
            self._snap = None
            log.info("instance_verified", instance_id=instance_id)
            self._agree()

    def _agree(self) -> None:
        """Settle the terms among the verified instances; mark those that disagree."""
        verified = sorted((i for i in self._instances.values() if i.verified),
                          key=lambda i: i.proved)
        terms, out = agree(self.expected, [i.info for i in verified], self.terms)
        for inst in verified:
            why = out.get(inst.instance_id, "")
            if why != inst.mismatch:
                inst.mismatch = why
                self._snap = None
                if why:
                    log.warning("instance_mismatched", instance_id=inst.instance_id, why=why)
                else:
                    log.info("instance_agrees", instance_id=inst.instance_id)
            if not why and not inst.welcomed:
                inst.welcomed = True
                inst.load.cores = cpu_list(inst.info.cpus)  # never built for a stranger
                inst.load.gpus = cpu_list(inst.info.gpus)
                self._snap = None
                for listener in self._listeners:
                    listener.instance_admitted(inst)
        if terms != self.terms:
            self.terms = terms
            log.info("cluster_terms", model=terms.model, block_size=terms.block_size,
                     kv_namespace=terms.kv_namespace, max_model_len=terms.max_model_len)
            for listener in self.on_terms:
                listener(terms)

    def call_failed(self, instance_id: str, fatal: bool, cooldown_s: float) -> None:
        """A worker call failed. The breaker opens after BREAKER_THRESHOLD failures in a row, at
        once when `fatal` (the instance is unreachable) or when half-open."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        breaker = inst.breaker
        before = breaker.open_until
        if breaker.failed(fatal, cooldown_s):
            log.warning("breaker_open", instance_id=instance_id, failures=breaker.failures,
                        cooldown_s=cooldown_s)
        if breaker.open_until != before:
            self._next_close = min(self._next_close, breaker.open_until)
            self._snap = None

    def call_succeeded(self, instance_id: str) -> None:
        inst = self._instances.get(instance_id)
        if inst is not None:
            if inst.breaker.trial:
                self._snap = None
                log.info("breaker_closed", instance_id=instance_id)
            inst.breaker.succeeded()

    def dispatched(self, request_id: str, instance_ids: Iterable[str]) -> None:
        """`request_id` was routed to these instances: a half-open one's probe."""
        for iid in set(instance_ids):
            inst = self._instances.get(iid)
            if inst is not None and inst.breaker.trial and inst.breaker.prober is None:
                inst.breaker.probe(request_id)
                self._snap = None
                log.info("breaker_probe", instance_id=iid, request_id=request_id)

    def released(self, request_id: str, instance_ids: Iterable[str]) -> None:
        """`request_id` ended there: a probe that gave no verdict lets the next request probe."""
        for iid in set(instance_ids):
            inst = self._instances.get(iid)
            if inst is not None and inst.breaker.prober == request_id:
                inst.breaker.abandon_probe(request_id)
                self._snap = None

    def _half_open(self, now: float) -> None:
        """Breakers whose cool-down ended take a probe (half-open: one more failure opens
        them at once, as `failures` stays at the threshold)."""
        nxt = float("inf")
        for inst in self._instances.values():
            if inst.breaker.half_open(now):
                self._snap = None
                log.info("breaker_half_open", instance_id=inst.instance_id)
            elif inst.breaker.open:
                nxt = min(nxt, inst.breaker.open_until)
        self._next_close = nxt

    def set_role(self, instance_id: str, role: str) -> Instance:
        """Route an instance registered as "both" as `role` (prefill, decode or both)."""
        inst = self._instances[instance_id]
        if inst.info.role != "both":
            raise ValueError(f"{instance_id} registered as {inst.info.role!r}, not 'both': "
                             "its role cannot be switched")
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"unknown role {role!r}")
        if inst.load.role != role:
            inst.load.set_role(role)
            self._snap = None
            log.info("instance_switched", instance_id=instance_id, role=role)
        return inst

    def states(self) -> list[tuple[str, str, str, str]]:
        """Every instance's id, role, state and why it is unhealthy (for metrics)."""
        return [(i.instance_id, i.role, i.state, i.why) for i in self.all()]

    def views(self) -> list[InstanceLoad]:
        """The routable instances' loads now (for health and metrics; routing uses
        `snapshot`)."""
        self._cool_down()
        return [i.load.view() for i in self._instances.values() if i.routable]

    def mark_changed(self, instance_ids: Iterable[str]) -> None:
        """Something a snapshot shows of these instances changed outside their load."""
        self._dirty.update(instance_ids)

    def snapshot(self, now: float = 0.0, params: SchedulerParams | None = None,
                 cached_blocks: Callable[[str], int] | None = None) -> ClusterSnapshot:
        """The routable (not draining, not unhealthy) instances' loads, frozen. Kept up to
        date by patching the previous snapshot with the instances changed since
        (`LoadState.on_change`, `mark_changed`): its cost follows changes, not cluster size."""
        self._cool_down()
        snap, dirty = self._snap, self._dirty
        params = params or (snap.params if snap is not None else SchedulerParams())
        cached = cached_blocks or _none
        if snap is None or snap.params is not params:
            loads = tuple(i.load.view(cached(iid))
                          for iid, i in self._instances.items() if i.routable)
            snap = ClusterSnapshot(loads, now, params)
        else:
            insts = self._instances
            snap = snap.replacing([i.load.view(cached(iid)) for iid in dirty
                                   if (i := insts.get(iid)) is not None and i.routable], now)
        dirty.clear()
        self._snap = snap
        return snap

    async def close(self) -> None:
        for inst in list(self._instances.values()):
            for listener in self._listeners:
                listener.instance_left(inst)
            await inst.channel.close(grace=None)
        self._instances.clear()
        self._snap = None


def _none(_: str) -> int:
    return 0

