"""The OpenAI-compatible HTTP endpoint (FastAPI on uvicorn with uvloop).

One request: parse and validate (`protocol`), tokenize (`chat` renders a conversation first),
set the sampling (`sampling`), then the pipeline routes, prefills and decodes, and `response`
shapes the deltas as JSON or SSE. Errors before the first token are HTTP errors; after it they
are SSE error events. A client that goes away cancels the pipeline, whose worker RPCs abort
their engine requests on both instances.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from cluster.instance import InstanceInfo
from cluster.membership import MembershipWatcher
from cluster.workers import WorkerSpec
from conductor import body as request_body
from conductor import openapi
from conductor.admin import AdminServer
from conductor.arrival import Arrival, arrived
from conductor.auth import ApiKeyMiddleware, tenant_salt
from conductor.chat import ChatTemplate
from conductor.config import ConductorConfig
from conductor.control_state import ControlState
from conductor.control_store import ControlStore, EtcdControlStore, MemoryControlStore
from conductor.deltas import Delta
from conductor.errors import (
    ConductorError,
    ModelNotFound,
    Overloaded,
    error_body,
    error_payload,
    http_status,
)
from conductor.flow import PRIORITY_HEADER, FlowControl, Ticket
from conductor.health import HealthChecker
from conductor.metrics import CLIENT_CLOSED, CONTENT_TYPE, Metrics, RequestTimer
from conductor.pipeline import Outcome, Pipeline
from conductor.pool_stats import PoolStatsPoller
from conductor.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from conductor.provision import Provisioner
from conductor.registry import Registry
from conductor.request_ids import RequestIds, client_request_id
from conductor.response import ResponseSpec, collect, stream
from conductor.sampling import ModelDefaults, sampling
from conductor.scheduler import DECODES_ALONE
from conductor.scheduler.pool_sync import PoolSync
from conductor.step_targets import StepTargets
from conductor.tenants import Tenants
from conductor.terms import Expected
from conductor.tokenizer import Tokenizer
from conductor.tracing import Tracing
from protos import worker_pb2

log = structlog.get_logger(__name__)

REASON_HEADER = "x-kvcluster-reason"
"""Why a request was refused (429, 503): the error's code, e.g. `slo_unattainable`,
`tenant_token_rate`, `batch_queue_timeout`."""
OFFLOAD_BYTES = 16 << 10
"""Bodies larger than this are understood (`Conductor._understand`) off the event loop."""

T = TypeVar("T")
_Understood = tuple[GenerationRequest, RequestIds, ResponseSpec, list[int],
                    worker_pb2.SamplingParams]
"""A request as `Conductor._understand` makes it: validated, its ids, its response's shape,
its prompt tokens and sampling parameters."""


class Membership(Protocol):
    """Where the instances come from: etcd in production (`MembershipWatcher`), a fixed set
    in tests."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def members(self) -> dict[str, InstanceInfo]: ...


class Conductor:
    """Everything the endpoint needs, started and stopped with the app."""

    def __init__(self, config: ConductorConfig,
                 membership: Callable[[Callable], Membership] | None = None,
                 control: ControlStore | None = None) -> None:
        self.config = config
        self.registry = Registry(config.cluster_secret, config.tls, Expected(
            models=frozenset({config.served_model_name, os.path.basename(
                config.model.rstrip("/"))}),
            block_size=config.block_size))
        self.tokenizer = Tokenizer(config.model)
        self.registry.on_terms.append(
            lambda terms: self.tokenizer.serve_within([terms.max_model_len]))
        self.chat_template = ChatTemplate(self.tokenizer.hf)
        self.defaults = ModelDefaults.load(config.model)
        self.pipeline = Pipeline(config, self.registry, self.tokenizer)
        self.pool_stats: PoolStatsPoller | None = None
        self.step_targets: StepTargets | None = None
        self.metrics = Metrics(self.registry.views,
                               lambda: self.pool_stats.latest if self.pool_stats else {},
                               self.registry.states)
        self.registry.on_unhealthy.append(self.metrics.instance_unhealthy)
        self.pipeline.metrics = self.metrics
        self.tenants = Tenants(config.tenant_limits)
        self.flow = FlowControl(self.tenants, config.batch_max_wait_s, config.batch_queue_max,
                                self.metrics)
        self.pipeline.flow = self.flow
        self.pipeline.router.freed = self.flow.freed
        self.metrics.tracing = Tracing.from_config(config.otel_endpoint)
        make = membership or (lambda on_change: MembershipWatcher(
            config.etcd_access, prefix=config.membership_prefix, on_change=on_change))
        self.watcher = make(self._on_members)
        if control is None:  # beside a membership of the test's, this process's own
            control = (MemoryControlStore() if membership is not None else
                       EtcdControlStore(config.etcd_access, config.control_prefix))
        self.control = ControlState(config, control, self.registry, self.pipeline.router,
                                    self.tenants, self._tbt_slo_changed)
        self.started = int(time.time())
        self.health: HealthChecker | None = None
        self.provisioner = Provisioner(WorkerSpec.load(config.embedded_workers)
                                       if config.embedded_workers else None,
                                       max_engines=config.max_engines)
        self.admin: AdminServer | None = None
        self.pool_sync: PoolSync | None = None
        self.in_flight = 0
        """Requests being answered (a stream counts until its generator ends)."""

    def _tbt_slo_changed(self) -> None:
        if self.step_targets is not None:  # the engines' step target follows it
            self.step_targets.slo_changed()

    async def _on_members(self, members: dict) -> None:
        self._sync(members)

    def _sync(self, members: dict[str, InstanceInfo]) -> None:
        self.registry.sync(members)

    def pool_namespaces(self) -> set[str]:
        """The pool keys' namespaces the index follows (`PoolSync`): the cluster's."""
        return {self.registry.terms.kv_namespace} - {""}

    async def start(self) -> None:
        self.health = HealthChecker(self.registry, self.config.health_interval_s)
        self.pool_stats = PoolStatsPoller(self.registry, self.config.stats_interval_s)
        self.step_targets = StepTargets(self.registry, lambda: self.pipeline.router.tbt_slo_s)
        self.pipeline.router.transfer_s_per_block = self.pool_stats.seconds_per_block
        await self.control.start()  # before any instance joins: a drained one joins drained
        await self.watcher.start()
        self._sync(self.watcher.members())
        if self.config.pool_keys_url:
            self.pool_sync = PoolSync(
                self.pipeline.router.index, self.config.pool_keys_url,
                self.pool_namespaces,
                self.config.pool_sync_s)
            self.pool_sync.start()
        if self.config.admin_port:
            self.admin = AdminServer(self, self.provisioner)
            await self.admin.start()

    async def stop(self) -> None:
        if self.pool_sync is not None:
            await self.pool_sync.close()
        if self.admin is not None:
            await self.admin.stop()
        await self.control.close()
        await self.watcher.close()
        if self.health is not None:
            await self.health.close()
        if self.pool_stats is not None:
            await self.pool_stats.close()
        if self.step_targets is not None:
            await self.step_targets.close()
        await self.registry.close()
        await self.provisioner.close()
        if self.metrics.tracing is not None:
            self.metrics.tracing.shutdown()

    def _finished(self, ticket: Ticket, outcome: Outcome) -> None:
        self.in_flight -= 1
        self.flow.release(ticket, outcome.prompt_tokens + outcome.completion_tokens)

    def ready(self) -> tuple[bool, str]:
        views = self.registry.views()
        policy = self.pipeline.router.policy_name
        if policy not in DECODES_ALONE and not any(v.can_prefill() for v in views):
            return False, "no prefill-capable instance is up"
        if not any(v.can_decode() for v in views):
            return False, "no decode-capable instance is up"
        return True, "ok"

    # ---------------------------------------------------------------- one request

    async def serve(self, request: Request, chat: bool) -> Response:
        parent = Tracing.parent(request.headers) if self.metrics.tracing is not None else None
        timer = self.metrics.timer("chat" if chat else "completions", parent,
                                   arrived(request.scope))
        timer.timeline.mark("accepted")
        try:
            understood = await self._parse(request, chat)
            # a slot is taken only by a request that arrived whole and parsed: clients holding
            # half-sent bodies take none; batch requests waiting in the flow's queue take none
            if self.in_flight - self.flow.queued >= self.config.max_in_flight:
                raise Overloaded(f"the conductor holds {self.in_flight} requests, its limit; "
                                 "retry later", code="conductor_full", retry_after=1.0)
            tenant = request.scope.get("state", {}).get("tenant", "")
            _, _, _, token_ids, params = understood
            ticket = self.flow.admit(
                tenant, self.flow.priority(tenant, request.headers.get(PRIORITY_HEADER)),
                len(token_ids) + params.max_tokens * (params.n or 1))
            self.in_flight += 1
            outcome = Outcome(timeline=timer.timeline)
            timer.on_finish = lambda: self._finished(ticket, outcome)
            return await self._serve(request, understood, ticket, outcome, timer)
        except request_body.ClientGone:
            log.info("client_disconnected", stage="body")
            timer.end(CLIENT_CLOSED)
            return _closed()
        except ConductorError as err:
            status = http_status(err)
            if status in (429, 503):
                self.metrics.reject(err.code or str(status))
            timer.end(status)
            raise
        except asyncio.CancelledError:
            timer.end(CLIENT_CLOSED)
            raise
        except Exception:
            timer.end(500)
            raise

    async def _parse(self, request: Request, chat: bool) -> _Understood:
        """The body read (ClientGone if the client leaves first) and understood."""
        raw = await request_body.read(request, self.config.max_body_bytes,
                                      self.config.http_body_timeout_s)
        args = (raw, chat, request.headers.get("x-request-id"))
        # A large body's decoding, templating and tokenizing (0.7 ms per 500 tokens) in a
        # thread: the loop, which carries every other stream's tokens, runs meanwhile.
        return (await asyncio.to_thread(self._understand, *args) if len(raw) > OFFLOAD_BYTES
                else self._understand(*args))

    async def _serve(self, request: Request, understood: _Understood, ticket: Ticket,
                     outcome: Outcome, timer: RequestTimer) -> Response:
        req, ids, spec, token_ids, params = understood
        request_id = ids.internal
        structlog.contextvars.bind_contextvars(**ids.log())
        prep = self.pipeline.prepare(
            request_id, token_ids, params, tenant_salt(ticket.tenant, req.cache_salt),
            ttft_slo_s=req.ttft_slo_ms / 1000 if req.ttft_slo_ms is not None else None,
            tbt_slo_s=req.tbt_slo_ms / 1000 if req.tbt_slo_ms is not None else None,
            loosen_slos=ticket.state.limits.may_loosen_slo, priority=ticket.priority)
        timer.timeline.mark("prepared")
        timer.timeline.attrs.update(**ids.log(), prompt_tokens=len(token_ids),
                                    stream=bool(req.stream), priority=ticket.priority)
        deltas = self.pipeline.run(prep, outcome, ticket)
        headers = {"X-Request-Id": ids.public}
        # Until the response starts, a disconnect is only noticed by listening for it.
        if not req.stream:
            timer.hold()  # its timeline is sunk once the answer is out (0.3 ms sooner)
            body = await _unless_disconnected(request, self._collect(spec, outcome, deltas, timer))
            if body is _GONE:
                timer.end(CLIENT_CLOSED)
                return _closed()
            if self.config.hide_kv_transfer:
                body.pop("kv_transfer", None)
            return JSONResponse(body, headers=headers, background=BackgroundTask(_sink, timer))
        first = await _unless_disconnected(request, anext(deltas, None))
        if first is _GONE:
            await deltas.aclose()
            timer.end(CLIENT_CLOSED)
            return _closed()
        if first is not None:
            timer.tokens(len(first.token_ids))
        timer.hold()  # its timeline is sunk once the stream's last bytes are out
        return SSEResponse(stream(spec, outcome, first, self._observed(deltas, outcome, timer)),
                           headers=headers, ended=timer.answered)

    async def _collect(self, spec: ResponseSpec, outcome: Outcome,
                       deltas: AsyncIterator[Delta], timer: RequestTimer) -> dict:
        return await collect(spec, outcome, None, self._observed(deltas, outcome, timer))

    def _understand(self, raw: bytes, chat: bool, header_id: str | None) -> _Understood:
        """The body as a request: validated, its ids, its response's shape, its tokens."""
        body = request_body.decode(raw)
        req: GenerationRequest = parse_chat(body) if chat else parse_completion(body)
        if req.model and req.model != self.config.served_model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist. Valid aliases: "
                                f"{self.config.served_model_name}.", param="model")
        ids = RequestIds.of("chatcmpl" if chat else "cmpl",
                            client_request_id(header_id, req.request_id))
        return req, ids, *self._plan(req, ids.public)

    def _plan(self, req: GenerationRequest, request_id: str
              ) -> tuple[ResponseSpec, list[int], worker_pb2.SamplingParams]:
        tok = self.tokenizer
        echo_text: str | None = None
        role = "assistant"
        if isinstance(req, ChatCompletionRequest):
            token_ids = tok.encode_text(self.chat_template.render(req), req.add_special_tokens)
            if not req.add_generation_prompt and req.messages:
                role = req.messages[-1].role
            if req.echo and req.messages and req.messages[-1].role == role:
                echo_text = req.messages[-1].text() or None
        else:
            assert isinstance(req, CompletionRequest)
            token_ids = tok.encode_prompt(req.prompt, req.add_special_tokens)
            if req.echo:
                echo_text = req.prompt if isinstance(req.prompt, str) else tok.decode(token_ids)
        s = sampling(req, len(token_ids), tok.max_model_len, tok.vocab_size, self.defaults)
        k = req.num_logprobs()
        opts = req.stream_options
        completion_echo = echo_text is not None and isinstance(req, CompletionRequest)
        spec = ResponseSpec(
            chat=isinstance(req, ChatCompletionRequest), request_id=request_id,
            model=self.config.served_model_name, created=int(time.time()), n=req.n or 1,
            logprobs=k, echo_text=echo_text,
            echo_ids=token_ids if completion_echo else None,
            echo_first_token=tok.decode(token_ids[:1]) if completion_echo and k is not None
            else "",
            echo_only=s.echo_only, return_token_ids=bool(req.return_token_ids),
            prompt_token_ids=token_ids,
            include_usage=bool(opts and opts.include_usage),
            continuous_usage=bool(opts and opts.include_usage and opts.continuous_usage_stats),
            role=role)
        return spec, token_ids, s.params

    async def _observed(self, deltas: AsyncIterator[Delta], outcome: Outcome,
                        timer: RequestTimer) -> AsyncIterator[Delta]:
        """The deltas, timed; the request is counted when they end, however they end."""
        status: int | str = CLIENT_CLOSED
        try:
            async for d in deltas:
                timer.tokens(len(d.token_ids))
                yield d
            status = 200
            self.metrics.cache_hit(outcome.prompt_tokens, outcome.cached_tokens,
                                   outcome.blocks_loaded * self._block_size())
        except ConductorError as err:
            status = http_status(err)
            raise
        finally:
            timer.finish(status)
            await deltas.aclose()

    def _block_size(self) -> int:
        try:
            return self.pipeline.block_size()
        except ConductorError:
            return 0


class SSEResponse(StreamingResponse):
    """`text/event-stream` whose generator is closed as soon as the response ends, so a
    client that went away aborts the request now rather than when the generator is
    collected; then `ended` is called."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str],
                 ended: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self._ended = ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            self._ended()


_GONE: Any = object()


async def _sink(timer: RequestTimer) -> None:
    """After the answer went out (a coroutine: Starlette runs a plain function in a thread)."""
    timer.answered()


def _closed() -> Response:
    """What a request whose client went away answers (nobody reads it; 499 as nginx logs)."""
    return Response(status_code=499)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, or `_GONE` once the client has disconnected (the work is cancelled, and
    with it the worker RPCs). The body must have been read already. The work runs in this
    task (another task and a wait for it cost a loop turn before the answer goes out)."""
    me = asyncio.current_task()
    assert me is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnect(request.receive)
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone or me.uncancel():  # not ours, or the caller cancelled too
            raise
        return _GONE
    finally:
        watcher.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(config: ConductorConfig,
               membership: Callable[[Callable], Membership] | None = None,
               control: ControlStore | None = None) -> FastAPI:
    """The ASGI app; `membership` replaces the etcd watcher (tests), `control` the etcd
    control state (with `membership`: one in memory)."""
    conductor = Conductor(config, membership, control)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await conductor.start()
        log.info("conductor_ready", host=config.host, port=config.port,
                 model=config.served_model_name, chat_template_builtin=conductor.chat_template
                 .builtin, api_keys=len(config.api_keys))
        yield
        await conductor.stop()

    app = FastAPI(title="kvcluster conductor", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.state.conductor = conductor
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)
    app.add_middleware(Arrival)  # added last: the outermost, before the key check

    @app.exception_handler(ConductorError)
    async def _conductor_error(request: Request, err: ConductorError) -> JSONResponse:
        headers = {}
        if err.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(err.retry_after)))
        status = http_status(err)
        if status in (429, 503) and err.code:
            headers[REASON_HEADER] = err.code
        if status >= 500:
            log.warning("answer_5xx", status=status, path=request.url.path, error=err.message)
        return JSONResponse(error_body(err), status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        from http import HTTPStatus

        body = error_payload(str(err.detail), HTTPStatus(err.status_code).phrase,
                             err.status_code)
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal_error", error=repr(err))
        return JSONResponse(error_payload("Internal server error", "InternalServerError", 500),
                            status_code=500)

    @app.get("/health")
    async def health() -> Response:
        ok, why = conductor.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": why,
                             "routable": len(conductor.registry.views())},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(conductor.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": conductor.started,
            "owned_by": "kvcluster", "root": config.model, "parent": None,
            "max_model_len": conductor.tokenizer.max_model_len, "permission": [],
        }]})

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await conductor.serve(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await conductor.serve(request, chat=True)

    described = openapi.build(app, secured=bool(config.api_keys))
    app.openapi = lambda: described  # type: ignore[method-assign]
    return app
