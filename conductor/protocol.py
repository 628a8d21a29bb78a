"""The OpenAI request bodies the conductor accepts, validated as vLLM's server validates them.

Pydantic checks the types; `_check` applies vLLM's range rules (its `SamplingParams` and
request validators) and raises `InvalidRequest` naming the parameter. Unknown fields are
ignored, as by vLLM and OpenAI. Fields vLLM knows but the cluster does not implement are
accepted only at their defaults (400 otherwise), never silently dropped.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema

from conductor.errors import InvalidRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
"""The wire's (`protos/worker.proto`) integer fields are int32."""
FLOAT32_MAX = 3.4028234663852886e38
"""The wire's float fields are float32: a larger finite value would arrive as inf."""
MAX_STOP_STRINGS = 4
"""vLLM's VLLM_MAX_STOP_STRINGS."""
MAX_LOGPROBS = 20
"""vLLM's default --max-logprobs."""
MAX_N = 128
"""vLLM allows 16384; OpenAI 128. One request may not occupy the cluster that long."""
MAX_CACHE_SALT = 128
MAX_SLO_MS = 3_600_000.0

TokenId = Annotated[int, Field(ge=0)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerationRequest(_Body):
    """What both endpoints share: model, sampling, streaming, and vLLM's extra parameters."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    n: int | None = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    user: str | None = None
    cache_salt: str | None = None
    ttft_slo_ms: float | None = Field(
        default=None, description="This request's time-to-first-token SLO in ms (default: the "
        "conductor's); when no instance is predicted to meet it, 429 before any work.")
    tbt_slo_ms: float | None = Field(
        default=None, description="This request's time-between-tokens SLO in ms (default: the "
        "conductor's).")
    request_id: Annotated[str, Field(min_length=1, max_length=128,
                                     pattern=r"^[\x21-\x7e]+$")] | None = Field(
        default=None, description="Optional caller-chosen id: 1-128 visible ASCII characters "
        "(it goes into the response's id and headers; requests sharing it stay apart).")
    return_token_ids: bool | None = None
    response_format: dict[str, Any] | None = Field(
        default=None, description="Only {'type': 'text'} (no structured outputs).")
    # vLLM features the cluster does not implement: only their defaults are accepted, and
    # the OpenAPI description leaves them out.
    logit_bias: SkipJsonSchema[dict[str, float] | None] = None
    use_beam_search: SkipJsonSchema[bool] = False
    allowed_token_ids: SkipJsonSchema[list[int] | None] = None
    bad_words: SkipJsonSchema[list[str] | None] = None
    prompt_logprobs: SkipJsonSchema[int | None] = None
    logprob_token_ids: SkipJsonSchema[list[int] | None] = None
    structured_outputs: SkipJsonSchema[dict[str, Any] | None] = None
    priority: SkipJsonSchema[int] = 0

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: none asked)."""
        raise NotImplementedError


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[list[TokenId]], Field(min_length=1, max_length=1)]) = Field(
        description="Text or token ids; a list of one prompt is accepted (no batches).")
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: SkipJsonSchema[str | None] = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None

    def text(self) -> str | None:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, description="Deprecated: max_completion_tokens.")
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: SkipJsonSchema[str | None] = None
    documents: SkipJsonSchema[list[dict[str, str]] | None] = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def _bad(param: str | None, msg: str) -> InvalidRequest:
    return InvalidRequest(msg, param=param)


def _check_common(r: GenerationRequest) -> None:
    """vLLM's SamplingParams._verify_args and the shared request validators."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(r, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(name, f"{name} must be in [-2, 2], got {v}.")
    if r.repetition_penalty is not None and (not math.isfinite(r.repetition_penalty)
                                             or not 0 < r.repetition_penalty <= FLOAT32_MAX):
        raise _bad("repetition_penalty", "repetition_penalty must be a finite number greater "
                   f"than zero, got {r.repetition_penalty}.")
    t = r.temperature
    if t is not None:
        if not math.isfinite(t):
            raise _bad("temperature", f"temperature must be a finite number, got {t}.")
        if not 0.0 <= t <= 2.0:
            raise _bad("temperature", f"temperature must be in [0, 2], got {t}.")
    if r.top_p is not None and not 0.0 < r.top_p <= 1.0:
        raise _bad("top_p", f"top_p must be in (0, 1], got {r.top_p}.")
    if r.top_k is not None and r.top_k < -1:
        raise _bad("top_k", f"top_k must be 0 (disable), or at least 1, got {r.top_k}.")
    if r.top_k is not None and r.top_k > INT32_MAX:
        raise _bad("top_k", f"top_k must be at most {INT32_MAX}, got {r.top_k}.")
    if r.min_p is not None and not 0.0 <= r.min_p <= 1.0:
        raise _bad("min_p", f"min_p must be in [0, 1], got {r.min_p}.")
    n = 1 if r.n is None else r.n
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"n must be in [1, {MAX_N}], got {n}.")
    if n > 1 and t is not None and t < 1e-5:
        raise _bad("n", f"n must be 1 when using greedy sampling, got {n}.")
    if r.min_tokens < 0:
        raise _bad("min_tokens", "min_tokens must be greater than or equal to 0, "
                   f"got {r.min_tokens}.")
    if any(not s for s in r.stop_list()):
        raise _bad("stop", "stop cannot contain an empty string.")
    if r.stream_options is not None and not r.stream:
        raise _bad("stream_options", "Stream options can only be defined when `stream=True`.")
    if r.cache_salt is not None and (not r.cache_salt or len(r.cache_salt) > MAX_CACHE_SALT
                                     or any(c in "@/\\\0" for c in r.cache_salt)):
        raise _bad("cache_salt", "Parameter 'cache_salt' must be a non-empty string of at most "
                   "128 characters without '@', '/', '\\', or NUL.")
    for name in ("ttft_slo_ms", "tbt_slo_ms"):
        v = getattr(r, name)
        if v is not None and not (0 < v <= MAX_SLO_MS):
            raise _bad(name, f"{name} must be in (0, {MAX_SLO_MS}], got {v}.")
    k = r.num_logprobs()
    if k is not None and k != 0 and (k == -1 or k > MAX_LOGPROBS):
        shown = "the vocabulary" if k == -1 else k
        raise _bad("logprobs", f"Requested sample logprobs of {shown}, which is greater than "
                   f"max allowed: {MAX_LOGPROBS}")
    _check_unsupported(r)


_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "logit_bias": (None, {}), "use_beam_search": (False,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "prompt_logprobs": (None,), "logprob_token_ids": (None,),
    "structured_outputs": (None,), "priority": (0,), "suffix": (None, ""),
    "chat_template": (None,), "documents": (None,),
}


def _check_unsupported(r: GenerationRequest) -> None:
    for name, defaults in _UNSUPPORTED_DEFAULTS.items():
        if getattr(r, name, None) not in defaults:
            raise _bad(name, f"`{name}` is not supported by this server.")
    fmt = r.response_format
    if fmt is not None and fmt.get("type") not in (None, "text"):
        raise _bad("response_format", "Only response_format {'type': 'text'} is supported by "
                   "this server (no structured outputs).")


def _check_completion(r: CompletionRequest) -> None:
    if r.prompt is None or r.prompt == "":
        raise _bad("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    if r.logprobs is not None and r.logprobs < 0 and r.logprobs != -1:
        raise _bad("logprobs", "`logprobs` must be a positive value or -1.")
    _check_max_tokens("max_tokens", r.max_tokens, allow_zero=bool(r.echo))


def _check_chat(r: ChatCompletionRequest) -> None:
    top = r.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise _bad("top_logprobs", "`top_logprobs` must be a positive value or -1.")
        if top != 0 and not r.logprobs:
            raise _bad("top_logprobs",
                       "when using `top_logprobs`, `logprobs` must be set to true.")
    if r.continue_final_message and r.add_generation_prompt:
        raise _bad(None, "Cannot set both `continue_final_message` and `add_generation_prompt` "
                   "to True.")
    _check_tools(r)
    name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    _check_max_tokens(name, r.output_limit(), allow_zero=False)


def _check_tools(r: ChatCompletionRequest) -> None:
    if r.tools == []:
        raise _bad("tools", "`tools` must not be an empty array. Either provide at least one "
                   "tool or omit the field entirely.")
    choice = r.tool_choice
    if choice == "none" or choice is None:
        return
    if not r.tools:
        raise _bad("tool_choice", "When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, NamedToolChoice) and not any(
            t.function.name == choice.function.name for t in r.tools):
        raise _bad("tool_choice", "The tool specified in `tool_choice` does not match any of "
                   "the specified `tools`")
    raise _bad("tool_choice", f"tool_choice {choice!r} is not supported by this server "
               "(no tool-call parser): use \"none\".")


def _check_max_tokens(param: str, value: int | None, allow_zero: bool) -> None:
    if value is not None and value < (0 if allow_zero else 1):
        raise _bad(param, f"{param} must be at least 1, got {value}.")


def parse_completion(body: object) -> CompletionRequest:
    """A JSON body as a validated request, or InvalidRequest naming the offending parameter."""
    if isinstance(body, dict) and body.get("prompt") in (None, "", []):
        raise _bad("prompt", "Either prompt or prompt_embeds must be provided and non-empty.")
    req = _parse(CompletionRequest, body)
    _check_common(req)
    _check_completion(req)
    return req


def parse_chat(body: object) -> ChatCompletionRequest:
    if isinstance(body, dict) and "tools" in body and "tool_choice" not in body and body["tools"]:
        body = {**body, "tool_choice": "auto"}  # vLLM's default once tools are given
    req = _parse(ChatCompletionRequest, body)
    _check_common(req)
    _check_chat(req)
    return req


def _parse(cls: type[GenerationRequest], body: object) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise _invalid(cls, e) from None


def _invalid(cls: type[BaseModel], e: ValidationError) -> InvalidRequest:
    """The first offending parameter, with every reason pydantic gave for it (a union field
    fails once per alternative)."""
    errors = e.errors(include_url=False)

    def where(err: Any) -> list[str]:  # field names and indices, not pydantic's markers
        return [str(p) for p in err.get("loc", ()) if isinstance(p, int) or p in _FIELDS]

    path = where(errors[0])
    param = path[0] if path else None
    reasons = list(dict.fromkeys(err.get("msg", "") for err in errors
                                 if (where(err) or [None])[0] == param))
    return InvalidRequest(f"Invalid value for `{'.'.join(path) or 'body'}`: "
                          f"{'; or '.join(reasons)[:500]}", param=param)


_FIELDS = {name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, Tool,
                          FunctionDefinition, NamedToolChoice, NamedFunction, StreamOptions)
           for name in m.model_fields}
