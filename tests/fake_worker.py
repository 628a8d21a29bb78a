"""A fake `Worker` gRPC service with explicit knobs, and the real conductor app over fakes,
served from a thread: the endpoint's behaviour in milliseconds, without engines.

The fake "generates" `w0 w1 w2 ...` (token ids 10, 11, ...), honours `n`, `max_tokens`,
stop strings and logprobs, and counts what it was asked and what was cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster import plane_tls
from cluster.health import SERVICE
from cluster.instance import InstanceInfo
from cluster.membership import Registration
from cluster.plane_tls import PlaneTLS
from cluster.secret import ClusterSecret, RequireToken
from protos import worker_pb2, worker_pb2_grpc


@dataclass
class Knobs:
    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0
    fail_after_chunks: int | None = None
    """Decode fails (gRPC INTERNAL) after sending this many chunks."""
    prefill_status: grpc.StatusCode | None = None
    """Prefill fails with this status."""
    decode_status: grpc.StatusCode = grpc.StatusCode.INTERNAL
    """The status of the `fail_after_chunks` failure."""
    fail_budget: list[int] | None = None
    """When set, decode failures happen only while it is positive (each takes one); share
    one list between workers' knobs to fail just the first stream, wherever it lands."""
    continue_sequence: bool = False
    """Generate `t<k>` tokens k = last prompt token + 1, + 2, ... (like a greedy model, a
    stream continued from prompt + output goes on where it broke) instead of w0, w1, ..."""
    pool: worker_pb2.PoolStats | None = None
    """What `Stats` reports of the pool connector (unset: no request finished yet)."""
    stats_delay_s: float = 0.0
    """`Stats` answers after this long (a hung worker)."""
    engine_times: bool = False
    """Report `EngineTimes` as a real worker does (queued, scheduled, first token, held)."""
    prefill_gate: threading.Event | None = None
    """When set, a prefill does not finish until the gate opens (after `prefill_delay_s`)."""
    decode_gate: threading.Event | None = None
    """When set, a decode produces no token until the gate opens (after its hold), or, with
    `gate_after_chunks`, none after that many."""
    gate_after_chunks: int = 0
    end_gate: threading.Event | None = None
    """When set, a decode's stream stays open after its last chunk until the gate opens."""
    step_target_unavailable: int = 0
    """`SetStepTarget` answers UNAVAILABLE this many times first (a worker not yet reachable)."""
    step_budget: bool = True
    """Whether the fake engine has a step budget (`SetStepTarget` answers `applied`)."""
    first_token_shift: int = 0
    """Added to the token id the first Prefill returns as the first token: the decode's
    differs, as a real decode's does when it was released without it (its hold timed out)."""


@dataclass
class Counts:
    prefills: int = 0
    generates: int = 0
    running: int = 0
    aborted: int = 0
    retired: int = 0
    stats: int = 0
    """`Stats` calls answered."""
    pool_ready: int = 0
    pool_ready_first: list[int | None] = field(default_factory=list)
    """The first token each `PoolReady` carried (None: none)."""
    last_params: worker_pb2.SamplingParams | None = None
    last_cache_salt: str = ""
    last_pool_wait: worker_pb2.PoolWait | None = None
    prefill_params: worker_pb2.SamplingParams | None = None
    """The sampling parameters of the latest Prefill that asked for the first token."""
    request_ids: list[str] = field(default_factory=list)
    step_targets: list[float] = field(default_factory=list)
    """Every `SetStepTarget` that reached the worker, in order (refused ones too)."""


def _times(received: float, released: float) -> worker_pb2.EngineTimes:
    """Engine times of a request that reached the worker at `received` and its engine at
    `released` (after being held for its prefill), scheduled and computed at once."""
    now = time.time()
    return worker_pb2.EngineTimes(received=received, queued=released, scheduled=released,
                                  first_token=max(now, released), held=released - received)


class FakePool:
    """What the fakes share of the pool: which requests' prefills wrote their blocks. A
    decode told to wait for a prefill's blocks (`PoolWait.wait_s`) waits here, as a real
    decode engine's loader does, then goes on (having "recomputed" what did not arrive)."""

    def __init__(self) -> None:
        self.written: dict[str, asyncio.Event] = {}

    def event(self, request_id: str) -> asyncio.Event:
        return self.written.setdefault(request_id, asyncio.Event())


class SilentHealth(health.aio.HealthServicer):
    """The standard health service, except that it does not answer while its worker's
    `health_silent` is set (a stopped process: connections open, nothing said)."""

    def __init__(self, worker: FakeWorker) -> None:
        super().__init__()
        self._worker = worker

    async def Check(self, request, context):
        while self._worker.health_silent:
            await asyncio.sleep(0.02)
        return await super().Check(request, context)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, knobs: Knobs, pool: FakePool | None = None) -> None:
        self.knobs = knobs
        self.counts = Counts()
        self.pool = pool or FakePool()
        self._ready: dict[str, asyncio.Event] = {}
        self.health_silent = False
        self.info: InstanceInfo | None = None
        """What it registered: its `Stats` report it, as a real worker's do."""

    async def Prefill(self, request, context):
        received = time.time()
        self.counts.prefills += 1
        self.counts.running += 1
        self.counts.request_ids.append(request.request_id)
        try:
            await asyncio.sleep(self.knobs.prefill_delay_s)
            gate = self.knobs.prefill_gate
            while gate is not None and not gate.is_set():  # the test's thread opens it
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.counts.aborted += 1
            raise
        finally:
            self.counts.running -= 1
        if self.knobs.prefill_status is not None:
            await context.abort(self.knobs.prefill_status, "injected prefill failure")
        self.pool.event(request.request_id).set()
        reply = worker_pb2.PrefillReply(num_prompt_tokens=len(request.token_ids))
        if request.HasField("params"):  # the first token, as the decode will sample it
            self.counts.prefill_params = request.params
            reply.first.CopyFrom(self._chunk(request.params, request, 0, 0, [""], first=True))
            if self.counts.prefills == 1:
                reply.first.token_ids[0] += self.knobs.first_token_shift
        if self.knobs.engine_times:
            reply.times.CopyFrom(_times(received, received))
        return reply

    async def Generate(self, request, context):
        p = request.params
        self.counts.generates += 1
        self.counts.running += 1
        self.counts.last_params = p
        self.counts.last_cache_salt = request.cache_salt
        self.counts.last_pool_wait = request.pool_wait
        self.counts.request_ids.append(request.request_id)
        sent = 0
        received = time.time()
        try:
            if request.pool_wait.wait_s > 0:  # held until PoolReady, else the blocks
                ready = self.ready(request.request_id) if request.pool_wait.hold else \
                    self.pool.event(request.request_id)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(request.pool_wait.wait_s):
                        await ready.wait()
            await self._gate(0)
            times = _times(received, time.time()) if self.knobs.engine_times else None
            texts = ["" for _ in range(p.n or 1)]
            for step in range(p.max_tokens):
                for index in range(p.n or 1):
                    if texts[index] is None:
                        continue
                    k = self.knobs
                    if k.fail_after_chunks is not None and sent >= k.fail_after_chunks \
                            and (k.fail_budget is None or k.fail_budget[0] > 0):
                        if k.fail_budget is not None:
                            k.fail_budget[0] -= 1
                        await context.abort(k.decode_status, "injected engine error")
                    await asyncio.sleep(self.knobs.token_delay_s)
                    if sent:
                        await self._gate(sent)
                    chunk = self._chunk(p, request, step, index, texts, first=sent == 0)
                    if times is not None and (sent == 0 or chunk.finish_reason):
                        chunk.times.CopyFrom(times)
                    yield chunk
                    sent += 1
            gate = self.knobs.end_gate
            while gate is not None and not gate.is_set():
                await asyncio.sleep(0.005)
        except (asyncio.CancelledError, GeneratorExit):
            # a call cancelled while grpc was sending a chunk closes the stream at its `yield`
            # (GeneratorExit), not at an `await` (seen once in make test: the abort uncounted)
            self.counts.aborted += 1
            raise
        finally:
            self.counts.running -= 1

    async def _gate(self, sent: int) -> None:
        """Hold the stream while `decode_gate` is shut, at `gate_after_chunks` chunks."""
        gate = self.knobs.decode_gate
        while gate is not None and sent == self.knobs.gate_after_chunks and not gate.is_set():
            await asyncio.sleep(0.005)  # the test's thread opens it

    def _chunk(self, p, request, step: int, index: int, texts: list, first: bool):
        if self.knobs.continue_sequence:
            token = request.token_ids[-1] + 1 + step
            text = f"t{token} "
        else:
            token, text = 10 + step, f"w{step} "
        chunk = worker_pb2.GenerateChunk(token_ids=[token], text=text, index=index)
        if first:
            chunk.num_prompt_tokens = len(request.token_ids)
        if p.logprobs:
            chunk.logprobs.append(-0.5)
            top = chunk.top_logprobs.add()
            top.top.add(token_id=token, logprob=-0.5, token=text)
            for j in range(p.logprobs):
                top.top.add(token_id=1000 + j, logprob=-1.0 - j, token=f"alt{j}")
        if first and p.HasField("prompt_logprobs"):
            chunk.prompt_logprobs.add()
            for t in request.token_ids[1:]:
                chunk.prompt_logprobs.add().top.add(token_id=t, logprob=-2.0, token=f"p{t}")
        texts[index] += text
        hit = next((s for s in p.stop if s in texts[index]), None)
        if hit is not None:
            chunk.text = text[:text.find(hit)] if hit in text else ""
            chunk.finish_reason, chunk.stop_str = "stop", hit
            texts[index] = None
        elif step == p.max_tokens - 1:
            chunk.finish_reason = "length"
        return chunk

    def ready(self, request_id: str) -> asyncio.Event:
        return self._ready.setdefault(request_id, asyncio.Event())

    async def PoolReady(self, request, context):
        self.counts.pool_ready += 1
        self.counts.pool_ready_first.append(
            request.first_token if request.HasField("first_token") else None)
        self.ready(request.request_id).set()
        return worker_pb2.PoolReadyReply(found=True)

    async def Abort(self, request, context):
        return worker_pb2.AbortReply(found=False)

    async def Stats(self, request, context):
        await asyncio.sleep(self.knobs.stats_delay_s)
        self.counts.stats += 1
        return worker_pb2.WorkerStats(running=self.counts.running,
                                      aborted_total=self.counts.aborted, pool=self.knobs.pool,
                                      registration=self.info.to_json() if self.info else b"")

    async def Retire(self, request, context):
        self.counts.retired += 1
        return worker_pb2.RetireReply()

    async def SetStepTarget(self, request, context):
        self.counts.step_targets.append(request.step_ms)
        if len(self.counts.step_targets) <= self.knobs.step_target_unavailable:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        if not self.knobs.step_budget:
            return worker_pb2.StepTargetReply(applied=False)
        return worker_pb2.StepTargetReply(applied=True, step_ms=request.step_ms)


class StaticMembership:
    def __init__(self, members: dict[str, InstanceInfo]) -> None:
        self._members = members

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def members(self) -> dict[str, InstanceInfo]:
        return dict(self._members)


class LocalConductor:
    """The conductor app with fake workers (`roles`), in a thread of its own."""

    def __init__(self, model_dir: str, roles: tuple[str, ...] = ("prefill", "decode"),
                 knobs: Knobs | None = None, conductor_args: tuple[str, ...] = (),
                 max_model_len: int = 0, secret_file: str = "",
                 impostors: tuple[str, ...] = (), tls_dir: str = "",
                 overrides: dict[str, dict] | None = None,
                 strangers: tuple[InstanceInfo, ...] = (), etcd: str = "",
                 lease_ttl: int = 3, prefix: str = "") -> None:
        self.model_dir = model_dir
        self.tls_dir = tls_dir
        """The worker plane's TLS files (`cluster.plane_tls`): workers serve TLS only."""
        self.secret_file = secret_file
        """A cluster secret (`cluster.secret`) the conductor and the workers hold, except
        `impostors` (instance ids), which serve every call and prove nothing."""
        self.impostors = impostors
        self.overrides = overrides or {}
        """Fields of some workers' registrations (by instance id) set to other values: those
        workers were started so (their `Stats` report the same)."""
        self.strangers = strangers
        """Registrations in membership with no worker of their own behind them (their
        addresses reach nothing, or another worker)."""
        self.etcd = etcd
        """A real etcd (host:port): the workers register there (`cluster.membership`, on
        leases of `lease_ttl` s, under `prefix`) and the conductor watches it; strangers are
        then the test's to put. Empty: a membership the test changes (`put_member`)."""
        self.lease_ttl = lease_ttl
        self.prefix = prefix or f"/kvcluster-test/{uuid.uuid4().hex[:8]}/instances/"
        """The membership prefix (a fresh one unless given: another conductor's, to serve
        its workers as a second replica, `roles=()`); the control state sits beside it."""
        self.registrations: dict[str, Registration] = {}
        self.max_model_len = max_model_len
        """What the fake workers announce as their engines' context (0: unknown)."""
        self.roles = roles
        self.knobs = knobs or Knobs()
        self.conductor_args = conductor_args
        self.workers: dict[str, FakeWorker] = {}
        self.addresses: dict[str, str] = {}
        # bound here and handed to uvicorn: a port only chosen here can be taken by another
        # process's connection before the server binds it (a clean-clone CI run: EADDRINUSE)
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections of such sockets;
        # without it an answer's two writes (headers, body) met delayed ACKs, ~44 ms each
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def served_name(self) -> str:
        """The model name the conductor serves (its model directory's, as the workers')."""
        return self.model_dir.rstrip("/").split("/")[-1]

    def put_member(self, info: InstanceInfo) -> None:
        """A registration appears or changes in membership (as a put in etcd would)."""
        self._change(lambda m: m.__setitem__(info.instance_id, info))

    def delete_member(self, instance_id: str) -> None:
        self._change(lambda m: m.pop(instance_id, None))

    def _change(self, edit) -> None:
        async def change() -> None:
            edit(self._members)
            await self._on_change(dict(self._members))

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(change(), self._loop).result(timeout=10)

    def call(self, fn):
        """`fn()` on the conductor's event loop (its state belongs to that loop); its result."""
        async def run():
            return fn()

        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def set_health(self, instance_id: str, status: int) -> None:
        """What a worker's health service says from now on (`cluster.health`)."""
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self.workers[instance_id].health.set(
            SERVICE, status), self._loop).result(timeout=10)

    @property
    def conductor(self):
        return self.app.state.conductor

    def worker(self, role: str) -> FakeWorker:
        return self.workers[f"{role}-0"]

    def __enter__(self) -> LocalConductor:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 120  # a start, not a measurement: a busy machine
        while self._server is None or not self._server.started:
            if self._error is not None:
                raise RuntimeError("local conductor failed") from self._error
            assert time.monotonic() < deadline, "local conductor did not start"
            time.sleep(0.02)
        registry = self.app.state.conductor.registry
        honest = [iid for iid in self.workers if iid not in self.impostors]
        while not all((i := registry.get(iid)) is not None and i.verified for iid in honest):
            assert time.monotonic() < deadline, "the local workers did not prove themselves"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._loop is not None and self._stop is not None
        self._server.should_exit = True
        self._loop.call_soon_threadsafe(self._stop.set)
        assert self._thread is not None
        self._thread.join(timeout=15)
        self._sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self._error = e

    async def _main(self) -> None:
        from conductor.app import create_app
        from conductor.config import parse_args
        from conductor.http_server import server_config

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers, members = [], {}
        seen: dict[str, int] = {}
        pool = FakePool()
        secret = ClusterSecret.load(self.secret_file)
        tls = PlaneTLS.load(self.tls_dir, "server")
        for role in self.roles:
            iid = f"{role}-{seen.setdefault(role, 0)}"
            seen[role] += 1
            fake = self.workers[iid] = FakeWorker(self.knobs, pool)
            guard = RequireToken(secret) if secret and iid not in self.impostors else None
            server = grpc.aio.server(interceptors=[guard] if guard else None)
            worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
            fake.health = SilentHealth(fake)
            health_pb2_grpc.add_HealthServicer_to_server(fake.health, server)
            port = plane_tls.bind(server, "127.0.0.1:0", tls)
            await server.start()
            await fake.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
            servers.append(server)
            self.addresses[iid] = f"127.0.0.1:{port}"
            if guard is not None:
                guard.bind(self.addresses[iid])
            info = InstanceInfo(instance_id=iid, role=role, address=f"127.0.0.1:{port}",
                                model=self.served_name, block_size=32,
                                capacity_tokens=1 << 20, version="test",
                                max_model_len=self.max_model_len, kv_namespace="kv-fake",
                                max_seqs=64)
            members[iid] = fake.info = dataclasses.replace(info, **self.overrides.get(iid, {}))
        members.update((s.instance_id, s) for s in self.strangers)
        config = parse_args(["--model", self.model_dir, "--etcd", self.etcd or "127.0.0.1:1",
                             "--membership-prefix", self.prefix,
                             "--port", str(self.port), "--kv-events", "false",
                             "--secret-file", self.secret_file, "--tls-dir", self.tls_dir,
                             *self.conductor_args])
        self._members = members

        def membership(on_change) -> StaticMembership:
            self._on_change = on_change
            return StaticMembership(members)

        app = self.app = create_app(config, membership=None if self.etcd else membership)
        for iid, fake in self.workers.items() if self.etcd else ():  # the loop is free now
            assert fake.info is not None
            reg = self.registrations[iid] = Registration(self.etcd, fake.info, prefix=self.prefix,
                                                         ttl=self.lease_ttl)
            await reg.start(timeout=10)
        self._server = uvicorn.Server(server_config(app, config, host="127.0.0.1",
                                                    port=self.port, loop="asyncio",
                                                    lifespan="on"))
        serving = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
        await self._stop.wait()
        await serving
        for reg in self.registrations.values():
            await reg.stop()
        for server in servers:
            await server.stop(grace=None)
