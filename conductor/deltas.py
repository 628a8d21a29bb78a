"""What a request's output is made of on its way to the client: `Delta`s of new tokens, text
and logprobs per choice, built from the decode worker's `GenerateChunk`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos import worker_pb2


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprobs: the chosen (or prompt) token's, and the top candidates'."""

    token_id: int
    token: str
    logprob: float | None
    """None for the first prompt token, which has no logprob."""
    top: tuple[tuple[str, float], ...]
    """The chosen token first, then the top-k, as the engine ranked them."""


@dataclass(slots=True)
class Delta:
    """New output of one choice (`index` < n) since its previous delta."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string or token id that ended the choice (None: EOS, length, ...)."""
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """When asked (echo with logprobs): one per prompt token, the first None."""


def from_chunk(chunk: worker_pb2.GenerateChunk, held: list[worker_pb2.TokenLogprobs]) -> Delta:
    """A chunk as a delta; `held`: prompt logprobs of earlier chunks that had no output."""
    d = Delta(index=chunk.index, text=chunk.text, token_ids=list(chunk.token_ids),
              finish_reason=chunk.finish_reason or None)
    which = chunk.WhichOneof("stop_reason")
    if which is not None:
        d.stop_reason = getattr(chunk, which)
    if chunk.top_logprobs:
        d.logprobs = [_logprob(t, top) for t, top in zip(chunk.token_ids, chunk.top_logprobs,
                                                         strict=False)]
    if held or chunk.prompt_logprobs:
        d.prompt_logprobs = [_logprob(None, top) if top.top else None
                             for top in (*held, *chunk.prompt_logprobs)]
    return d


def _logprob(token_id: int | None, top: worker_pb2.TokenLogprobs) -> TokenLogprob:
    """The wire's list holds the chosen token first (for a prompt position: the prompt's)."""
    entries = top.top
    if not entries:
        return TokenLogprob(token_id or 0, "", None, ())
    own = entries[0]
    if token_id is not None and own.token_id != token_id:
        own = next((e for e in entries if e.token_id == token_id), own)
    return TokenLogprob(own.token_id, own.token, own.logprob,
                        tuple((e.token, e.logprob) for e in entries))
