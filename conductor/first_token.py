"""The first token from the prefill: on a disaggregated route the prefill engine samples the
prompt's first output token as the request would (its parameters, its seed), and the
conductor streams it at once instead of waiting for the decode engine beside it to load the
prompt's blocks and sample the same token (Mooncake's prefill instance produces the first
token too). The time to first token is then the prefill's, not prefill + transfer + decode
step.

The decode engine still produces that token (its stream is the request unchanged), made the
prefill's: `PoolReady` carries it and the decode engine's `worker.forced_token` logits
processor leaves only it possible, so sampling at random gives both engines the same token
without sharing a seed (the logprobs are the model's raw ones, bit-identical on both engines:
tests/test_e2e.py). The conductor drops it from the decode's first chunk after checking it
is the one streamed; a mismatch (a decode released without `PoolReady`, after its hold timed
out) is `FirstTokenMismatch`, and the stream continues from what the client has
(`conductor.resilience.Diverged`).

Not for: several choices (`n` > 1), prompt logprobs (one set is sent, by the decode), stop
strings (the decode holds back text that might start one, a finished prefill does not), or a
decode whose own cache holds the prompt (it is not held for the prefill: no time to gain).
"""

from __future__ import annotations

from protos import worker_pb2


class FirstTokenMismatch(Exception):
    """The decode engine's first token is not the one the prefill gave and the client has."""


def prefill_params(params: worker_pb2.SamplingParams) -> worker_pb2.SamplingParams | None:
    """The parameters the prefill samples the first token with, or None where it must not."""
    if (params.n or 1) != 1 or params.HasField("prompt_logprobs") or len(params.stop):
        return None
    out = worker_pb2.SamplingParams()
    out.CopyFrom(params)
    return out


def usable(first: worker_pb2.GenerateChunk) -> bool:
    """A prefill's first-token chunk worth streaming: exactly one token."""
    return len(first.token_ids) == 1


def early_chunk(first: worker_pb2.GenerateChunk) -> worker_pb2.GenerateChunk:
    """What the client gets at once: the token, its text and logprobs, not finished yet (the
    decode's chunk says how the choice ends), no usage figures (the decode's first chunk has
    them)."""
    out = worker_pb2.GenerateChunk(token_ids=first.token_ids, text=first.text,
                                   logprobs=first.logprobs, top_logprobs=first.top_logprobs)
    return out


def strip_first(chunk: worker_pb2.GenerateChunk, sent: worker_pb2.GenerateChunk
                ) -> worker_pb2.GenerateChunk:
    """The decode's first chunk without the token already streamed (`sent`); the rest of it
    (later tokens, finish, usage, times) kept. FirstTokenMismatch when it is another token or
    its text differs."""
    if not chunk.token_ids:
        return chunk  # a bare finish or prompt-logprob chunk: nothing was produced twice
    if chunk.index != 0 or chunk.token_ids[0] != sent.token_ids[0]:
        raise FirstTokenMismatch(f"the decode's first token is {chunk.token_ids[0]} (choice "
                                 f"{chunk.index}), the prefill's {sent.token_ids[0]}")
    if not chunk.text.startswith(sent.text):
        raise FirstTokenMismatch(f"the decode's first text {chunk.text!r} does not start with "
                                 f"the prefill's {sent.text!r}")
    out = worker_pb2.GenerateChunk()
    out.CopyFrom(chunk)
    del out.token_ids[0]
    out.text = chunk.text[len(sent.text):]
    if out.logprobs:
        del out.logprobs[0]
    if out.top_logprobs:
        del out.top_logprobs[0]
    return out
