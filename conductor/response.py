"""OpenAI response bodies and SSE events, built as plain dicts from the pipeline's `Delta`s.

The shapes follow vLLM's server field for field (`vllm/entrypoints/openai/*/protocol.py`),
completions and chat alike; pydantic stays off this path. A failure after the response has
started becomes an error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from conductor.deltas import Delta, TokenLogprob
from conductor.errors import ConductorError, error_body
from conductor.pipeline import Outcome

log = structlog.get_logger(__name__)

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseSpec:
    """How one request's output is to be shown."""

    chat: bool
    request_id: str
    model: str
    created: int
    n: int = 1
    logprobs: int | None = None
    """Top logprobs asked per token (None: no logprobs)."""
    echo_text: str | None = None
    """Prepended to every choice (completions: the prompt; chat: the last message)."""
    echo_ids: list[int] | None = None
    """Completions echo: the prompt's ids, for token ids and logprobs."""
    echo_first_token: str = ""
    """Completions echo with logprobs: the first prompt token, which has no logprob."""
    echo_only: bool = False
    """Completions echo with max_tokens=0: the prompt alone."""
    return_token_ids: bool = False
    prompt_token_ids: list[int] = field(default_factory=list)
    include_usage: bool = False
    continuous_usage: bool = False
    role: str = "assistant"
    """Chat: the answer's role (the last message's when no generation prompt was added)."""


@dataclass
class _Choice:
    """One choice as it accumulates (non-streaming) or advances (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    started: bool = False
    text_offset: int = 0
    generated: int = 0


def usage(outcome: Outcome, completion_tokens: int | None = None) -> dict:
    done = outcome.completion_tokens if completion_tokens is None else completion_tokens
    return {"prompt_tokens": outcome.prompt_tokens, "total_tokens": outcome.prompt_tokens + done,
            "completion_tokens": done,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def _echo(spec: ResponseSpec, d: Delta) -> tuple[str, list[int], list[TokenLogprob | None]]:
    """A completion choice's first delta, with the prompt prepended as asked."""
    if spec.echo_text is None or spec.chat:
        return d.text, d.token_ids, list(d.logprobs)
    ids = spec.echo_ids or []
    lps: list[TokenLogprob | None] = []
    if spec.logprobs is not None:
        lps = list(d.prompt_logprobs) or [None] * len(ids)
        if lps and lps[0] is None and ids:
            lps[0] = TokenLogprob(ids[0], spec.echo_first_token, None, ())
    if spec.echo_only:
        return spec.echo_text, list(ids), lps
    return spec.echo_text + d.text, [*ids, *d.token_ids], [*lps, *d.logprobs]


def _completion_logprobs(lps: list[TokenLogprob | None], k: int, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        token = "" if lp is None else lp.token
        tokens.append(token)
        token_lps.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None or lp.logprob is None else dict(lp.top[:k + 1]))
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
            "top_logprobs": tops}


def _chat_logprobs(lps: list[TokenLogprob | None], k: int) -> dict:
    content = []
    for lp in lps:
        if lp is None or lp.logprob is None:
            continue
        content.append({"token": lp.token, "logprob": lp.logprob,
                        "bytes": list(lp.token.encode("utf-8", errors="replace")),
                        "top_logprobs": [{"token": t, "logprob": v,
                                          "bytes": list(t.encode("utf-8", errors="replace"))}
                                         for t, v in lp.top[:k]]})
    return {"content": content}


# ---------------------------------------------------------------- non-streaming


async def collect(spec: ResponseSpec, outcome: Outcome, first: Delta | None,
                  rest: AsyncIterator[Delta]) -> dict:
    """The whole response body once every choice has finished."""
    choices = [_Choice() for _ in range(spec.n)]
    try:
        if first is not None:
            _accumulate(spec, choices[first.index], first)
        async for d in rest:
            _accumulate(spec, choices[d.index], d)
    finally:
        await rest.aclose()
    body = {"id": spec.request_id, "object": "chat.completion" if spec.chat else "text_completion",
            "created": spec.created, "model": spec.model,
            "choices": [_final_choice(spec, i, c) for i, c in enumerate(choices)],
            "usage": usage(outcome)}
    if spec.chat and spec.return_token_ids:
        body["prompt_token_ids"] = spec.prompt_token_ids
    body["kv_transfer"] = {"prefill_instance": outcome.prefill_instance,
                           "decode_instance": outcome.decode_instance,
                           "blocks_saved": outcome.blocks_saved,
                           "blocks_in_pool": outcome.blocks_in_pool,
                           "blocks_loaded": outcome.blocks_loaded,
                           "first_token_from": outcome.first_token_from}
    return body


def _accumulate(spec: ResponseSpec, c: _Choice, d: Delta) -> None:
    if not c.started:
        c.started = True
        text, ids, lps = _echo(spec, d)
    elif spec.echo_only:
        text, ids, lps = "", [], []
    else:
        text, ids, lps = d.text, d.token_ids, d.logprobs
    c.text += text
    c.token_ids += ids
    c.logprobs += lps
    if d.finish_reason:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason


def _final_choice(spec: ResponseSpec, index: int, c: _Choice) -> dict:
    k = spec.logprobs
    if spec.chat:
        text = (spec.echo_text or "") + c.text
        out: dict = {"index": index,
                     "message": {"role": spec.role, "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None},
                     "logprobs": None if k is None else _chat_logprobs(c.logprobs, k),
                     "finish_reason": c.finish_reason or "stop", "stop_reason": c.stop_reason}
    else:
        out = {"index": index, "text": c.text,
               "logprobs": None if k is None else _completion_logprobs(c.logprobs, k, 0),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if spec.return_token_ids:
            out["prompt_token_ids"] = spec.prompt_token_ids
    if spec.return_token_ids:
        out["token_ids"] = c.token_ids[len(spec.echo_ids or ()):] if not spec.chat \
            else c.token_ids
    return out


# ---------------------------------------------------------------- streaming


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def stream(spec: ResponseSpec, outcome: Outcome, first: Delta | None,
                 rest: AsyncIterator[Delta]) -> AsyncIterator[bytes]:
    """SSE events, ending with `data: [DONE]` whatever happens."""
    choices = [_Choice() for _ in range(spec.n)]
    head = {"id": spec.request_id,
            "object": "chat.completion.chunk" if spec.chat else "text_completion",
            "created": spec.created, "model": spec.model}
    try:
        if spec.chat:
            for i in range(spec.n):
                yield _event(_chat_opening(spec, head, i))
                if spec.echo_text:
                    yield _event({**head, "choices": [{
                        "index": i, "delta": {"content": spec.echo_text}, "logprobs": None,
                        "finish_reason": None}]})
        if first is not None:
            yield _event(_chunk(spec, head, outcome, choices[first.index], first))
        async for d in rest:
            c = choices[d.index]
            if c.finish_reason is None:
                yield _event(_chunk(spec, head, outcome, c, d))
        if spec.include_usage:
            yield _event({**head, "choices": [], "usage": usage(outcome)})
    except ConductorError as err:
        log.warning("stream_failed", request_id=spec.request_id, error=err.message)
        yield _event(error_body(err))
    finally:
        await rest.aclose()  # a client that went away cancels the worker RPCs now
    yield DONE


def _chat_opening(spec: ResponseSpec, head: dict, index: int) -> dict:
    out = {**head, "choices": [{"index": index, "delta": {"role": spec.role, "content": ""},
                                "logprobs": None, "finish_reason": None}]}
    if spec.return_token_ids:
        out["prompt_token_ids"] = spec.prompt_token_ids
    if spec.continuous_usage:
        out["usage"] = {"prompt_tokens": len(spec.prompt_token_ids), "completion_tokens": 0,
                        "total_tokens": len(spec.prompt_token_ids)}
    return out


def _chunk(spec: ResponseSpec, head: dict, outcome: Outcome, c: _Choice, d: Delta) -> dict:
    k = spec.logprobs
    prompt_ids = None
    if not c.started:
        c.started = True
        text, _, lps = _echo(spec, d)
        prompt_ids = spec.prompt_token_ids if spec.return_token_ids and not spec.chat else None
    elif spec.echo_only:
        text, lps = "", []
    else:
        text, lps = d.text, d.logprobs
    c.generated += len(d.token_ids)
    c.finish_reason = d.finish_reason
    if spec.chat:
        choice: dict = {"index": d.index, "delta": {"content": text},
                        "logprobs": None if k is None else _chat_logprobs(lps, k),
                        "finish_reason": d.finish_reason}
    else:
        logprobs = None
        if k is not None:
            logprobs = _completion_logprobs(lps, k, c.text_offset)
            c.text_offset += sum(len(lp.token) for lp in lps if lp is not None)
        choice = {"index": d.index, "text": text, "logprobs": logprobs,
                  "finish_reason": d.finish_reason}
        if prompt_ids is not None:
            choice["prompt_token_ids"] = prompt_ids
    if d.finish_reason is not None:
        choice["stop_reason"] = d.stop_reason
    if spec.return_token_ids:
        choice["token_ids"] = d.token_ids
    out = {**head, "choices": [choice]}
    if spec.continuous_usage:
        out["usage"] = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": c.generated,
                        "total_tokens": outcome.prompt_tokens + c.generated}
    return out
