"""The OpenAPI description the conductor serves at /openapi.json.

Request bodies are the validating models of `protocol.py`; responses are described by the
models below, which exist for the description only (the endpoint builds plain dicts, see
`response.py`, and tests check the two agree).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from conductor.protocol import ChatCompletionRequest, CompletionRequest


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class KvTransfer(BaseModel):
    """Where the request ran and what moved through the pool (not in OpenAI's API)."""

    prefill_instance: str
    decode_instance: str
    blocks_saved: int
    blocks_in_pool: int
    blocks_loaded: int
    first_token_from: Literal["prefill", "decode"]
    """Which engine sampled the first token the client got (`conductor/first_token.py`)."""


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_transfer: KvTransfer | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: str
    content: str | None
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    kv_transfer: KvTransfer | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class StreamUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChunk(BaseModel):
    """One SSE event of a streamed completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: StreamUsage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: StreamUsage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None
    permission: list[dict[str, Any]]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str


_REQUESTS = (CompletionRequest, ChatCompletionRequest)
_RESPONSES = (ErrorResponse, CompletionResponse, ChatCompletionResponse, CompletionChunk,
              ChatCompletionChunk, ModelList, Health)
_ERRORS = {400: "Invalid request", 401: "Missing or wrong API key",
           404: "Unknown model", 429: "Overloaded: retry after `Retry-After` seconds",
           500: "Internal error", 502: "A worker failed",
           503: "No instance can take the request", 504: "A worker timed out"}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel], description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _sse(chunk: type[BaseModel]) -> dict:
    """One server-sent event (OpenAPI < 3.2: `schema` describes each event): its data is a
    chunk, an error object (a failure after the stream started), or the final `[DONE]`."""
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"}}}}}


def _errors(*codes: int) -> dict:
    return {str(c): _json(ErrorResponse, _ERRORS[c]) for c in codes}


def build(app: FastAPI, secured: bool) -> dict[str, Any]:
    """The whole description; `secured` adds the bearer scheme to the /v1 routes."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible endpoint of a KV-cache-centric, "
                                  "disaggregated prefill/decode cluster (vLLM's semantics).")
    _, defs = models_json_schema([(m, "validation") for m in _REQUESTS]
                                 + [(m, "serialization") for m in _RESPONSES],
                                 ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, req, resp, chunk in (
            ("/v1/completions", CompletionRequest, CompletionResponse, CompletionChunk),
            ("/v1/chat/completions", ChatCompletionRequest, ChatCompletionResponse,
             ChatCompletionChunk)):
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(req)}}}
        ok = _json(resp, "The completion; with `stream: true`, server-sent events ending "
                         "with `data: [DONE]`.")
        ok["content"].update(_sse(chunk))
        op["responses"] = {"200": ok, **_errors(400, 404, 429, 500, 502, 503, 504)}
    doc["paths"]["/v1/models"]["get"]["responses"] = {"200": _json(ModelList, "Served models"),
                                                      **_errors(500)}
    doc["paths"]["/health"]["get"]["responses"] = {
        "200": _json(Health, "Ready: a prefill- and a decode-capable instance are up"),
        "503": _json(Health, "Not ready")}
    doc["paths"]["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"].update(_errors(401))
    return doc
