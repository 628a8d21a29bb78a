"""A validated request's sampling parameters, as the workers receive them.

vLLM's rules: a parameter the request leaves out takes the model's `generation_config.json`
default, then the OpenAI default; `max_tokens` above the context is an error, but prompt plus
`max_tokens` over the context lowers `max_tokens` to fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conductor.errors import InvalidRequest
from conductor.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from protos import worker_pb2

OPENAI_DEFAULTS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


@dataclass(frozen=True)
class ModelDefaults:
    """Sampling defaults from the model's generation config (vLLM's `--generation-config auto`)."""

    values: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None

    @classmethod
    def load(cls, model_dir: str) -> ModelDefaults:
        path = Path(model_dir, "generation_config.json")
        cfg = json.loads(path.read_text()) if path.exists() else {}
        values = {k: cfg[k] for k in OPENAI_DEFAULTS if cfg.get(k) is not None}
        return cls(values=values, max_tokens=cfg.get("max_new_tokens"))


@dataclass(frozen=True)
class Sampling:
    """What the pipeline sends, and what the response needs to know of it."""

    params: worker_pb2.SamplingParams
    max_tokens: int
    echo_only: bool = False
    """`echo` with `max_tokens=0`: one token is generated, only the prompt is returned."""


def sampling(req: GenerationRequest, prompt_len: int, max_model_len: int, vocab_size: int,
             defaults: ModelDefaults) -> Sampling:
    limit, param = _requested_limit(req)
    if limit is not None and limit > max_model_len:
        raise InvalidRequest(f"{param}={limit} cannot be greater than max_model_len="
                             f"{max_model_len}. Please request fewer output tokens.",
                             param=param)
    echo_only = isinstance(req, CompletionRequest) and bool(req.echo) and limit == 0
    candidates = [max_model_len - prompt_len, limit if limit else defaults.max_tokens]
    max_tokens = 1 if echo_only else min(c for c in candidates if c is not None)
    if req.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens must be less than or equal to max_tokens={max_tokens}"
                             f", got {req.min_tokens}.", param="min_tokens")
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token "
                             f"ids. Vocabulary size: {vocab_size}", param="stop_token_ids")
    v = {k: getattr(req, k) if getattr(req, k) is not None else defaults.values.get(k, d)
         for k, d in OPENAI_DEFAULTS.items()}
    k = req.num_logprobs()
    params = worker_pb2.SamplingParams(
        n=req.n or 1,
        max_tokens=max_tokens,
        temperature=v["temperature"],
        top_p=v["top_p"],
        top_k=int(v["top_k"]) or -1,
        min_p=v["min_p"],
        stop=req.stop_list(),
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        # The wire's 0 means none; the response trims back to what was asked.
        logprobs=0 if k is None else max(k, 1),
        ignore_eos=req.ignore_eos,
        presence_penalty=v["presence_penalty"],
        frequency_penalty=v["frequency_penalty"],
        repetition_penalty=v["repetition_penalty"],
        min_tokens=req.min_tokens,
        skip_special_tokens=req.skip_special_tokens,
    )
    if req.seed is not None:
        params.seed = req.seed
    if isinstance(req, CompletionRequest) and req.echo and k is not None:
        params.prompt_logprobs = k  # echo with logprobs covers the prompt too
    return Sampling(params=params, max_tokens=max_tokens, echo_only=echo_only)


def _requested_limit(req: GenerationRequest) -> tuple[int | None, str]:
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            return req.max_completion_tokens, "max_completion_tokens"
        return req.max_tokens, "max_tokens"
    assert isinstance(req, CompletionRequest)
    return (16 if req.max_tokens is None else req.max_tokens), "max_tokens"
