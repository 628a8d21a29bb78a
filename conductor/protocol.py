"""The OpenAI request bodies the conductor accepts, validated as vLLM's server does."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from conductor.errors import InvalidRequest


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions. Unknown fields are ignored, as by vLLM and OpenAI."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    n: int = 1
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    return_token_ids: bool = False
    user: str | None = None
    request_id: str | None = Field(default=None, description="Optional caller-chosen id.")

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        _check_ranges(self)
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _check_ranges(r: CompletionRequest) -> None:
    def bad(param: str, msg: str) -> InvalidRequest:
        return InvalidRequest(msg, param=param)

    if r.temperature is not None and (math.isnan(r.temperature) or not 0 <= r.temperature <= 2):
        raise bad("temperature", f"temperature must be in [0, 2], got {r.temperature}")
    if r.top_p is not None and (math.isnan(r.top_p) or not 0 < r.top_p <= 1):
        raise bad("top_p", f"top_p must be in (0, 1], got {r.top_p}")
    if r.top_k is not None and r.top_k < -1:
        raise bad("top_k", f"top_k must be -1 (disable), or at least 1, got {r.top_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(r, name)
        if math.isnan(v) or not -2 <= v <= 2:
            raise bad(name, f"{name} must be in [-2, 2], got {v}")
    if r.repetition_penalty is not None and not r.repetition_penalty > 0:
        raise bad("repetition_penalty", "repetition_penalty must be positive")
    if r.n != 1:
        raise bad("n", "n must be 1 (several choices per request are not supported yet)")
    if r.max_tokens is not None and r.max_tokens < 1:
        raise bad("max_tokens", f"max_tokens must be at least 1, got {r.max_tokens}")
    if r.min_tokens < 0:
        raise bad("min_tokens", "min_tokens must be non-negative")
    if r.logprobs is not None and not 0 <= r.logprobs <= 20:
        raise bad("logprobs", f"logprobs must be in [0, 20], got {r.logprobs}")
    if r.stream_options is not None and not r.stream:
        raise bad("stream_options", "Stream options can only be defined when `stream=True`.")
    if any(s == "" for s in r.stop_list()):
        raise bad("stop", "stop strings must not be empty")
    if r.echo:
        raise bad("echo", "echo is not supported yet")


def parse_completion(body: object) -> CompletionRequest:
    """A JSON body as a validated request, or InvalidRequest naming the offending parameter."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, InvalidRequest):
            raise cause from None
        raise InvalidRequest(f"{param}: {first.get('msg')}", param=param) from None
