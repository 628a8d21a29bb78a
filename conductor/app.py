"""The OpenAI-compatible HTTP endpoint (FastAPI on uvicorn with uvloop)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.membership import MembershipWatcher
from conductor.config import ConductorConfig
from conductor.errors import ConductorError, InvalidRequest, ModelNotFound, error_body, mapping
from conductor.pipeline import Delta, Outcome, Pipeline, Prepared
from conductor.protocol import CompletionRequest, parse_completion
from conductor.registry import Registry
from conductor.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


class Conductor:
    """Everything the endpoint needs, started and stopped with the app."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.registry = Registry()
        self.tokenizer = Tokenizer(config.model)
        self.pipeline = Pipeline(config, self.registry, self.tokenizer)
        self.watcher = MembershipWatcher(config.etcd, prefix=config.membership_prefix,
                                         on_change=self._on_members)
        self.started = int(time.time())

    async def _on_members(self, members: dict) -> None:
        self.registry.sync(members)

    async def start(self) -> None:
        await self.watcher.start()
        self.registry.sync(self.watcher.members())

    async def stop(self) -> None:
        await self.watcher.close()
        await self.registry.close()

    def ready(self) -> tuple[bool, str]:
        snap = self.registry.snapshot()
        if not snap.prefill():
            return False, "no prefill-capable instance is up"
        if not snap.decode():
            return False, "no decode-capable instance is up"
        return True, "ok"


def create_app(config: ConductorConfig) -> FastAPI:
    conductor = Conductor(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await conductor.start()
        log.info("conductor_ready", host=config.host, port=config.port,
                 model=config.served_model_name)
        yield
        await conductor.stop()

    app = FastAPI(title="kvcluster conductor", version="0.1.0", lifespan=lifespan)
    app.state.conductor = conductor

    @app.exception_handler(ConductorError)
    async def _conductor_error(request: Request, err: ConductorError) -> JSONResponse:
        headers = {}
        if err.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(err.retry_after)))
        return JSONResponse(error_body(err), status_code=mapping(err).http, headers=headers)

    @app.get("/health")
    async def health() -> Response:
        ok, why = conductor.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": why},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": conductor.started,
            "owned_by": "kvcluster", "root": config.model,
            "max_model_len": conductor.tokenizer.max_model_len,
        }]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"invalid JSON body: {e}") from None
        req = parse_completion(body)
        if req.model is not None and req.model != config.served_model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist.", param="model",
                                code=404)
        prep = conductor.pipeline.prepare(req)
        structlog.contextvars.bind_contextvars(request_id=prep.request_id)
        outcome = Outcome()
        deltas = conductor.pipeline.run(prep, outcome)
        # Errors before the first token are HTTP errors; after it they are stream events.
        first = await anext(deltas, None)
        if req.stream:
            return StreamingResponse(_sse(req, prep, outcome, first, deltas, config),
                                     media_type="text/event-stream")
        return JSONResponse(await _collect(req, prep, outcome, first, deltas, config))

    return app


def _choice(req: CompletionRequest, d: Delta, text: str) -> dict:
    choice: dict = {"index": 0, "text": text, "logprobs": None,
                    "finish_reason": d.finish_reason, "stop_reason": None}
    if req.logprobs is not None:
        choice["logprobs"] = {
            "tokens": d.tokens, "token_logprobs": d.logprobs,
            "top_logprobs": d.top_logprobs if req.logprobs else None, "text_offset": [],
        }
    if req.return_token_ids:
        choice["token_ids"] = d.token_ids
    return choice


def _usage(outcome: Outcome) -> dict:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


async def _collect(req: CompletionRequest, prep: Prepared, outcome: Outcome, first: Delta | None,
                   rest: AsyncIterator[Delta], config: ConductorConfig) -> dict:
    total = Delta()
    deltas = [first] if first is not None else []
    try:
        deltas += [d async for d in rest]
    finally:
        await rest.aclose()
    for d in deltas:
        total.text += d.text
        total.token_ids += d.token_ids
        total.logprobs += d.logprobs
        total.tokens += d.tokens
        total.top_logprobs += d.top_logprobs
        total.finish_reason = d.finish_reason or total.finish_reason
    body = {
        "id": prep.request_id, "object": "text_completion", "created": int(time.time()),
        "model": config.served_model_name, "choices": [_choice(req, total, total.text)],
        "usage": _usage(outcome),
    }
    if req.return_token_ids:
        body["choices"][0]["prompt_token_ids"] = prep.token_ids
    body["kv_transfer"] = {"prefill_instance": outcome.prefill_instance,
                           "decode_instance": outcome.decode_instance,
                           "blocks_saved": outcome.blocks_saved,
                           "blocks_in_pool": outcome.blocks_in_pool,
                           "blocks_loaded": outcome.blocks_loaded}
    return body


async def _sse(req: CompletionRequest, prep: Prepared, outcome: Outcome, first: Delta | None,
               rest: AsyncIterator[Delta], config: ConductorConfig) -> AsyncIterator[bytes]:
    created = int(time.time())

    def event(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": prep.request_id, "object": "text_completion", "created": created,
               "model": config.served_model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    try:
        if first is not None:
            yield event(chunk([_choice(req, first, first.text)]))
        async for d in rest:
            yield event(chunk([_choice(req, d, d.text)]))
        if req.stream_options and req.stream_options.include_usage:
            yield event(chunk([], _usage(outcome)))
    except ConductorError as err:
        log.warning("stream_failed", request_id=prep.request_id, error=err.message)
        yield event(error_body(err))
    finally:
        await rest.aclose()  # a client that went away cancels the worker RPC now
    yield b"data: [DONE]\n\n"
