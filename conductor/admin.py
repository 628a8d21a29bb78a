"""The conductor's gRPC admin API (`protos/admin.proto`), served beside the HTTP endpoint with
the standard health and reflection services.

Every Admin call needs `authorization: Bearer <token>` when a token is configured; a missing
or wrong one is UNAUTHENTICATED before the call runs, so it changes nothing. Health and
reflection stay open (they reveal nothing an operator's load balancer should not see).

Drains, role switches, SLOs, the policy and tenants' limits change through the control state
(`conductor.control_state`): written to etcd first, then in force here; the other replicas
follow etcd. A change etcd cannot store answers UNAVAILABLE and changes nothing.

Pools change through `Provisioner`: embedded mode (the launcher handed the conductor a
`WorkerSpec`) starts worker processes here and retires drained surplus ones once idle; a
deployed cluster can only drain instances (kept as standbys that a later resize undrains)
and switch those registered as "both" (one engine able to prefill and decode) between roles.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conductor.control_state import ControlState
from conductor.errors import ConductorError, mapping
from conductor.provision import Provisioner
from conductor.registry import Instance, Registry
from conductor.resize import Member, ResizePlan, plan, serves
from conductor.scheduler.index import POOL
from protos import admin_pb2, admin_pb2_grpc, worker_pb2

log = structlog.get_logger(__name__)

SERVICE = "kvcluster.v1.Admin"
_ADMIN_PREFIX = f"/{SERVICE}/"
_DEFAULT_WAIT_S = 300.0
_POLL_S = 0.2


class TokenAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for an Admin call without the right bearer token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong admin token (authorization: Bearer <token>)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(_ADMIN_PREFIX):
            got = dict(details.invocation_metadata or ()).get("authorization", "")
            if not hmac.compare_digest(str(got).encode(), self._expected):
                log.warning("admin_unauthenticated", method=details.method)
                return self._deny
        return await continuation(details)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, conductor: Any, provisioner: Provisioner) -> None:
        self.c = conductor
        self.registry: Registry = conductor.registry
        self.router = conductor.pipeline.router
        self.provisioner = provisioner
        self.control: ControlState = conductor.control
        self._resize_lock = asyncio.Lock()

    async def _change(self, context: grpc.aio.ServicerContext, change: Awaitable[Any]) -> Any:
        """A control state change: INVALID_ARGUMENT for a bad value, UNAVAILABLE when it could
        not be stored (nothing changed then)."""
        try:
            return await change
        except ConductorError as e:
            log.warning("control_change_failed", error=e.message)
            await context.abort(mapping(e).grpc, e.message)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # ---------------------------------------------------------------- instances

    def _instance(self, inst: Instance) -> admin_pb2.Instance:
        v = inst.load.view()
        return admin_pb2.Instance(
            instance_id=inst.instance_id, role=inst.role, address=inst.info.address,
            state=inst.state, in_flight=v.in_flight, model=inst.info.model,
            block_size=inst.info.block_size, advertised_role=inst.info.role,
            running=v.running, kv_tokens=v.kv_tokens, kv_capacity_tokens=v.kv_capacity_tokens,
            queued_prompt_tokens=v.queued_prompt_tokens,
            cached_blocks=self.router.index.blocks(inst.instance_id),
            dispatched_total=inst.load.dispatched_total, version=inst.info.version,
            mismatch=inst.mismatch, why=inst.why)

    async def ListInstances(self, request: admin_pb2.ListInstancesRequest,
                            context: grpc.aio.ServicerContext) -> admin_pb2.ListInstancesReply:
        insts = sorted(self.registry.all(), key=lambda i: (i.role, i.instance_id))
        return admin_pb2.ListInstancesReply(instances=[self._instance(i) for i in insts])

    # ---------------------------------------------------------------- pools

    def _serving(self, role: str) -> list[Instance]:
        return [i for i in self.registry.all() if i.routable and serves(i.role, role)]

    def _members(self) -> list[Member]:
        return [Member(i.instance_id, i.role, i.info.role, i.routable, i.draining, i.unhealthy,
                       i.load.in_flight(), self.provisioner.started_here(i.instance_id),
                       i.info.side) for i in self.registry.all()]

    def _joined(self, instance_id: str) -> bool:
        inst = self.registry.get(instance_id)
        return inst is not None and inst.verified

    async def ResizePool(self, request: admin_pb2.ResizePoolRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.ResizePoolReply:
        """Plans (`conductor.resize`) and acts under one lock, so that calls at once see each
        other's starts; a plan that starts workers the machine cannot hold is refused
        (FAILED_PRECONDITION) before anything changes. `wait` waits outside the lock."""
        async with self._resize_lock:
            starting = self.provisioner.starting(self._joined)
            try:
                p = plan(request.role, request.target, self._members(), starting,
                         self.provisioner.can_start)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            engines = len({i.instance_id for i in self.registry.all()}
                          | {s.instance_id for s in starting})  # all on this machine
            why = self.provisioner.refusal(p.start, engines, len(starting))
            if why:
                log.warning("pool_resize_refused", role=p.role, target=p.target, reason=why)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"cannot start {p.start} {p.role} worker(s): {why}")
            reply = await self._apply(p, context)
        wait_for = [*reply.started, *reply.starting]
        if request.wait and wait_for:
            timeout = request.timeout_s or _DEFAULT_WAIT_S
            if not await self._until(lambda: all(
                    (i := self.registry.get(iid)) is not None and i.routable
                    for iid in wait_for), timeout):
                missing = [iid for iid in wait_for if self.registry.get(iid) is None]
                reply.unmet = (f"started instances not routable after {timeout:.0f}s: "
                               f"{missing}; see their logs")
        reply.after = len(self._serving(p.role))
        log.info("pool_resized", role=p.role, target=p.target, before=reply.before,
                 after=reply.after, started=list(reply.started),
                 starting=list(reply.starting), drained=list(reply.drained),
                 switched=list(reply.switched), undrained=list(reply.undrained),
                 cancelled=list(reply.cancelled), unmet=reply.unmet)
        return reply

    async def _apply(self, p: ResizePlan, context: grpc.aio.ServicerContext
                     ) -> admin_pb2.ResizePoolReply:
        """The plan's drains, undrains and switches in one change of the control state (with
        the records of the workers it starts cleared: a new process is not drained), then the
        processes started, cancelled and retired."""
        reply = admin_pb2.ResizePoolReply(role=p.role, target=p.target, before=p.before,
                                          starting=p.starting, undrained=p.undrain,
                                          cancelled=p.cancel)
        names = [self.provisioner.name(p.role) for _ in range(p.start)]
        changes: dict[str, dict[str, Any]] = {iid: {"draining": False, "role": ""}
                                              for iid in names}
        changes.update((iid, {"draining": False}) for iid in p.undrain)
        for iid, role in p.switch:
            changes.setdefault(iid, {})["role"] = role
        changes.update((iid, {"draining": True}) for iid in p.drain)
        if changes:
            await self._change(context, self.control.set_instances(changes))
        reply.switched.extend(iid for iid, _ in p.switch)
        for iid in p.cancel:
            self.provisioner.cancel(iid)
        for iid in names:  # a thread each: the event loop serves on meanwhile
            reply.started.append(await asyncio.to_thread(self.provisioner.start, p.role, iid))
        for iid in p.drain:
            inst = self.registry.get(iid)
            reply.drained.append(iid)
            if inst is not None and self.provisioner.can_start:  # else kept as a standby
                self.provisioner.retire_when_idle(inst)
        if p.short:
            how = ("deploy/prefill.sh with KVCLUSTER_WORKER_ROLE=both" if p.role == "both" else
                   f"deploy/{p.role}.sh (KVCLUSTER_WORKER_ROLE=both makes them switchable)")
            reply.unmet = (f"{p.short} {p.role} instance(s) short: a deployed cluster cannot "
                           f"start processes; start workers with {how}")
        return reply

    async def Drain(self, request: admin_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.DrainReply:
        iid = request.instance_id
        if self.registry.get(iid) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no instance {iid!r}")
        await self._change(context, self.control.set_instances({iid: {"draining": True}}))
        inst = self.registry.get(iid)
        if inst is None:
            return admin_pb2.DrainReply(instance_id=iid, state="absent")
        if request.wait:
            await self._until(lambda: inst.load.in_flight() == 0,
                              request.timeout_s or _DEFAULT_WAIT_S)
        return self._drain_reply(inst)

    async def Undrain(self, request: admin_pb2.DrainRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.DrainReply:
        iid = request.instance_id
        if self.registry.get(iid) is None and iid not in self.control.instance_records():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no instance {iid!r}")
        await self._change(context, self.control.set_instances({iid: {"draining": False}}))
        inst = self.registry.get(iid)
        if inst is None:
            return admin_pb2.DrainReply(instance_id=iid, state="absent")
        return self._drain_reply(inst)

    @staticmethod
    def _drain_reply(inst: Instance) -> admin_pb2.DrainReply:
        n = inst.load.in_flight()
        return admin_pb2.DrainReply(instance_id=inst.instance_id, state=inst.state,
                                    in_flight=n, idle=inst.draining and n == 0)

    @staticmethod
    async def _until(done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    # ---------------------------------------------------------------- SLOs

    async def SetSLO(self, request: admin_pb2.SetSLORequest,
                     context: grpc.aio.ServicerContext) -> admin_pb2.SetSLOReply:
        name = self.c.config.served_model_name
        if request.model and request.model != name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"this conductor serves {name!r}, not {request.model!r}")
        if request.ttft_ms < 0 or request.tbt_ms < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "SLOs must be positive")
        if request.ttft_ms or request.tbt_ms:
            await self._change(context, self.control.set_slo(request.ttft_ms / 1000 or None,
                                                             request.tbt_ms / 1000 or None))
        return admin_pb2.SetSLOReply(model=name, ttft_ms=self.router.ttft_slo_s * 1000,
                                     tbt_ms=self.router.tbt_slo_s * 1000)

    # ---------------------------------------------------------------- policy

    async def SetPolicy(self, request: admin_pb2.SetPolicyRequest,
                        context: grpc.aio.ServicerContext) -> admin_pb2.PolicyReply:
        if request.policy or request.disaggregate:
            await self._change(context, self.control.set_policy(request.policy,
                                                                request.disaggregate))
        return admin_pb2.PolicyReply(policy=self.router.policy_name,
                                     disaggregate=self.router.disaggregate)

    # ---------------------------------------------------------------- prewarm

    async def Prewarm(self, request: admin_pb2.PrewarmRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.PrewarmReply:
        c = self.c
        t0 = time.perf_counter()
        try:
            if request.token_ids:
                ids = c.tokenizer.check_ids(list(request.token_ids))
            elif request.prompt:
                ids = c.tokenizer.encode_prompt(request.prompt)
            else:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "give a prompt or token_ids")
            params = worker_pb2.SamplingParams(max_tokens=1, temperature=0.0)
            prep = c.pipeline.prepare(f"prewarm-{uuid.uuid4().hex[:12]}", ids, params,
                                      request.cache_salt,
                                      ttft_slo_s=c.config.prefill_timeout_s)
            out = await c.pipeline.prewarm(prep, list(request.instances))
        except ConductorError as e:
            await context.abort(mapping(e).grpc, e.message)
        blocks = len(prep.block_hashes)
        seconds = time.perf_counter() - t0
        log.info("prewarmed", prompt_tokens=len(ids), blocks=blocks,
                 written=out.blocks_saved, in_pool=out.blocks_in_pool, warmed=out.warmed,
                 seconds=round(seconds, 3))
        return admin_pb2.PrewarmReply(prompt_tokens=len(ids), blocks=blocks,
                                      blocks_written=out.blocks_saved,
                                      blocks_in_pool=out.blocks_in_pool, warmed=out.warmed,
                                      seconds=seconds)

    # ---------------------------------------------------------------- index

    async def IndexStats(self, request: admin_pb2.IndexStatsRequest,
                         context: grpc.aio.ServicerContext) -> admin_pb2.IndexStatsReply:
        idx, k = self.router.index, self.router.counters
        n = len(idx)
        mem = idx.memory_bytes()
        return admin_pb2.IndexStatsReply(
            blocks=n, max_blocks=idx.max_blocks, memory_bytes=mem,
            bytes_per_block=mem / n if n else 0.0, forgotten=idx.evicted,
            locations=[admin_pb2.LocationBlocks(location=loc, blocks=idx.blocks(loc))
                       for loc in sorted(idx.locations(), key=lambda x: (x != POOL, x))],
            routed=k.routed, rejected=k.rejected, local_prefills=k.local_prefills,
            predicted_hit_tokens=k.predicted_hit_tokens,
            reported_hit_tokens=k.reported_hit_tokens,
            prompt_tokens=k.reported_prompt_tokens,
            hit_ratio=k.reported_hit_tokens / k.reported_prompt_tokens
            if k.reported_prompt_tokens else 0.0)


    # ---------------------------------------------------------------- tenants

    def _tenant(self, tenant: str) -> admin_pb2.TenantStatus:
        tenants = self.c.tenants
        limits = tenants.limits(tenant)
        state = tenants.states().get(tenant)
        bucket = state.bucket if state is not None else None
        return admin_pb2.TenantStatus(
            tenant=tenant, max_concurrency=limits.max_concurrency,
            tokens_per_s=limits.tokens_per_s, priority=limits.priority,
            may_loosen_slo=limits.may_loosen_slo, own_limits=tenant in tenants.configured(),
            in_flight=state.in_flight if state else 0,
            tokens_available=max(bucket.level, 0.0) if bucket else 0.0,
            admitted=state.admitted if state else 0, rejected=state.rejected if state else 0)

    async def SetTenantLimits(self, request: admin_pb2.SetTenantLimitsRequest,
                              context: grpc.aio.ServicerContext) -> admin_pb2.TenantStatus:
        name = request.tenant
        fields = ("max_concurrency", "tokens_per_s", "priority", "may_loosen_slo")
        changes = {f: getattr(request, f) for f in fields if request.HasField(f)}
        await self._change(context, self.control.set_tenant(name, changes, request.reset))
        status = self._tenant(name)
        log.info("tenant_limits_set", tenant=name, max_concurrency=status.max_concurrency,
                 tokens_per_s=status.tokens_per_s, priority=status.priority,
                 may_loosen_slo=status.may_loosen_slo, reset=request.reset)
        return status

    async def ListTenants(self, request: admin_pb2.ListTenantsRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.ListTenantsReply:
        tenants = self.c.tenants
        names = sorted(set(tenants.configured()) | set(tenants.states()))
        return admin_pb2.ListTenantsReply(tenants=[self._tenant(n) for n in names],
                                          batch_queued=self.c.flow.queued)


class AdminServer:
    """The grpc.aio server of the admin API, with health and reflection."""

    def __init__(self, conductor: Any, provisioner: Provisioner) -> None:
        cfg = conductor.config
        self.config = cfg
        interceptors = [TokenAuth(cfg.admin_token)] if cfg.admin_token else []
        self.server = grpc.aio.server(interceptors=interceptors,
                                      options=[("grpc.so_reuseport", 0)])
        self.servicer = AdminServicer(conductor, provisioner)
        admin_pb2_grpc.add_AdminServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{cfg.admin_host}:{cfg.admin_port}")

    async def start(self) -> None:
        await self.server.start()
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("admin_api_ready", address=f"{self.config.admin_host}:{self.port}",
                 token=bool(self.config.admin_token))

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=2.0)
