"""Deterministic request workloads for the end-to-end benchmark.

Every generator is a pure function of its arguments: the same seed gives the same
`Workload`, token for token and arrival for arrival (numpy `Generator`s seeded from the
arguments, no global RNG). Requests are in arrival order; `arrival_s` is the open-loop send
offset from the start of the run, the first at 0.0. Token ids lie in `[vocab.lo, vocab.hi)`.

- `shared_prefix`: `n_groups` long prefixes, each shared by about `n_requests / n_groups`
  requests, the groups interleaved in arrival order; a unique suffix per request.
- `trace_derived`: a window of a Mooncake-format trace with its prefix reuse kept and its
  sizes scaled to the model (rule in its docstring).
- `low_reuse`: every prompt differs from every other at its first token.
- `multi_turn`: conversations, interleaved; each turn's prompt is the previous turn's prompt,
  its answer and a new question (the shape of the Mooncake traces). The answer is only known
  once generated, so a follow-up turn carries just its question and is sent by the client
  `think_s` after the previous turn's answer (closed loop within a conversation).

`reuse_ratio` is what an unlimited prefix cache would hit of a workload, in full blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from simulator.trace import TRACE_BLOCK, load_trace
from store.block_hash import block_hashes


@dataclass(frozen=True)
class Vocab:
    """Token ids `[lo, hi)`: ordinary tokens of the model's tokenizer, no special tokens."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"need 0 <= lo < hi: [{self.lo}, {self.hi})")

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    """Offset from the start of the run (open-loop arrivals)."""
    group: str | None
    """Shared-prefix group or trace prefix id; None if the prompt is unique."""
    follows: str | None = None
    """A follow-up turn: the request whose prompt and answer this one's prompt continues
    (`prompt_token_ids` is then only the new question, and `arrival_s` is unused)."""
    think_s: float = 0.0
    """A follow-up's pause between the previous answer and this question."""


@dataclass(frozen=True)
class Workload:
    name: str
    """"shared_prefix" | "trace" | "low_reuse" | "multi_turn"."""
    requests: tuple[BenchRequest, ...]
    description: str
    """One line: the shape (prefix lengths, groups, rate)."""


def shared_prefix(seed: int, n_requests: int, n_groups: int, prefix_tokens: int,
                  suffix_tokens: int, max_tokens: int, rate_rps: float,
                  vocab: Vocab) -> Workload:
    """Groups of requests on one long document each, interleaved as they arrive.

    Group g's requests all start with the same `prefix_tokens` ids, then a suffix of
    `suffix_tokens` ids no other request has. Requests are spread evenly over the groups
    (sizes differ by at most one) and their order is a seeded shuffle, so consecutive
    requests mostly belong to different groups. Poisson arrivals at `rate_rps`.
    """
    _check_positive(n_requests=n_requests, n_groups=n_groups, prefix_tokens=prefix_tokens,
                    suffix_tokens=suffix_tokens, max_tokens=max_tokens)
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_tokens, vocab) for _ in range(n_groups)]
    groups = rng.permutation(np.arange(n_requests) % n_groups)
    suffixes = _unique_rows(rng, n_requests, suffix_tokens, vocab)
    arrivals = _poisson_arrivals(rng, n_requests, rate_rps)
    requests = tuple(
        BenchRequest(f"shared_prefix-{i:05d}", prefixes[g] + suffixes[i], max_tokens,
                     arrivals[i], f"g{g}")
        for i, g in enumerate(groups.tolist()))
    return Workload("shared_prefix", requests,
                    f"{n_requests} requests in {n_groups} interleaved groups: "
                    f"{prefix_tokens}-token shared prefix + {suffix_tokens}-token unique "
                    f"suffix, {max_tokens} output tokens, Poisson {rate_rps:g} req/s")


def trace_derived(seed: int, trace_path: str | Path, n_requests: int, max_prompt_tokens: int,
                  max_tokens_cap: int, rate_rps: float, vocab: Vocab, *, start: int = 0,
                  block_tokens: int | None = None) -> Workload:
    """Lines `start .. start + n_requests` of a Mooncake-format trace, reuse kept, resized.

    Scaling rule: each 512-token trace block becomes `block_tokens` tokens, by default
    `max_prompt_tokens // B` with B the most blocks of any selected request, so the longest
    prompt fits. A request's prompt is the concatenation of its blocks' tokens cut to
    `ceil(input_length * block_tokens / 512)` (its partial last block scaled alike), and
    to `max_prompt_tokens` when `block_tokens` is given. Pass a multiple of the engine's
    block size as `block_tokens` to keep trace blocks aligned with KV blocks.

    Block `h`'s tokens are drawn from a generator seeded by `(seed, h)`: equal `hash_ids`
    prefixes give equal token prefixes, and a prompt differs from another from the first
    block whose id differs (with probability 1 - vocab.size ** -block_tokens).
    Output: `min(output_length, max_tokens_cap)`, at least 1. Arrivals: the trace's
    timestamps from the first one, rescaled so the mean rate is `rate_rps` (all at 0.0 if
    the timestamps are equal). Group: the first block id. Note the trace's reuse grows
    along it: its first few hundred lines reuse only a few percent of their blocks among
    themselves, its last few hundred about 66%.
    """
    _check_positive(n_requests=n_requests, max_prompt_tokens=max_prompt_tokens,
                    max_tokens_cap=max_tokens_cap)
    _check_rate(rate_rps)
    if start < 0:
        raise ValueError(f"start must be >= 0: {start}")
    trace = load_trace(trace_path, limit=start + n_requests)[start:]
    if len(trace) < n_requests:
        raise ValueError(f"{trace_path} has {len(trace) + start} lines, need "
                         f"{start + n_requests}")
    if block_tokens is None:
        block_tokens = max_prompt_tokens // max(len(r.hash_ids) for r in trace)
    if block_tokens < 1:
        raise ValueError(f"{max_prompt_tokens} tokens cannot hold the longest prompt's "
                         "blocks at one token each")
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        if h not in blocks:
            blocks[h] = _tokens(np.random.default_rng([seed, h]), block_tokens, vocab)
        return blocks[h]

    t0 = trace[0].arrival_s
    span = trace[-1].arrival_s - t0
    scale = (n_requests - 1) / (rate_rps * span) if span > 0 else 0.0
    requests = []
    for i, r in enumerate(trace):
        length = min(-(-r.input_length * block_tokens // TRACE_BLOCK), max_prompt_tokens)
        prompt = tuple(t for h in r.hash_ids for t in block(h))[:max(length, 1)]
        requests.append(BenchRequest(f"trace-{start + i:05d}", prompt,
                                     max(1, min(r.output_length, max_tokens_cap)),
                                     (r.arrival_s - t0) * scale, str(r.hash_ids[0])))
    return Workload("trace", tuple(requests),
                    f"trace lines {start}-{start + n_requests - 1} of {Path(trace_path).name}: "
                    f"{block_tokens} tokens per 512-token block, prompts <= "
                    f"{max(len(r.prompt_token_ids) for r in requests)} tokens, outputs <= "
                    f"{max_tokens_cap}, trace arrivals rescaled to {rate_rps:g} req/s")


def low_reuse(seed: int, n_requests: int, prompt_tokens: int, max_tokens: int, rate_rps: float,
              vocab: Vocab) -> Workload:
    """Prompts that share nothing: every first token is different (so `n_requests` must not
    exceed `vocab.size`). Poisson arrivals at `rate_rps`."""
    _check_positive(n_requests=n_requests, prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    if n_requests > vocab.size:
        raise ValueError(f"{n_requests} distinct first tokens need a vocab of that size, "
                         f"have {vocab.size}")
    rng = np.random.default_rng(seed)
    firsts = (rng.permutation(vocab.size)[:n_requests] + vocab.lo).tolist()
    arrivals = _poisson_arrivals(rng, n_requests, rate_rps)
    requests = tuple(
        BenchRequest(f"low_reuse-{i:05d}", (firsts[i],) + _tokens(rng, prompt_tokens - 1, vocab),
                     max_tokens, arrivals[i], None)
        for i in range(n_requests))
    return Workload("low_reuse", requests,
                    f"{n_requests} unique {prompt_tokens}-token prompts (no shared prefix), "
                    f"{max_tokens} output tokens, Poisson {rate_rps:g} req/s")


def multi_turn(seed: int, n_conversations: int, turns: int, doc_tokens: int,
               question_tokens: int, max_tokens: int, rate_rps: float, think_s: float,
               vocab: Vocab) -> Workload:
    """`n_conversations` conversations of `turns` turns each, starting at Poisson arrivals of
    `rate_rps / turns` (so that the request rate is about `rate_rps`): the first turn a
    `doc_tokens` document of its own plus a question, every later turn a new question of
    `question_tokens` sent `think_s` after the previous answer, its prompt the previous prompt
    plus that answer plus the question."""
    _check_positive(n_conversations=n_conversations, turns=turns, doc_tokens=doc_tokens,
                    question_tokens=question_tokens, max_tokens=max_tokens)
    rng = np.random.default_rng(seed)
    starts = _poisson_arrivals(rng, n_conversations, rate_rps / turns)
    requests = []
    for c in range(n_conversations):
        prev = None
        for t in range(turns):
            rid = f"multi_turn-{c:03d}-{t:02d}"
            prompt = (_tokens(rng, doc_tokens, vocab) if t == 0 else ()) \
                + _tokens(rng, question_tokens, vocab)
            requests.append(BenchRequest(rid, prompt, max_tokens, starts[c] if t == 0 else 0.0,
                                         f"c{c}", follows=prev,
                                         think_s=think_s if t else 0.0))
            prev = rid
    return Workload("multi_turn", tuple(requests),
                    f"{n_conversations} conversations of {turns} turns, interleaved: a "
                    f"{doc_tokens}-token document, then each turn the previous prompt + its "
                    f"{max_tokens}-token answer + a {question_tokens}-token question, "
                    f"{think_s:g} s after the answer; conversations start Poisson "
                    f"{rate_rps / turns:g}/s")


def _answer(i: int, n: int) -> tuple[int, ...]:
    """Placeholder ids for request i's answer (unique, beyond any vocabulary)."""
    return tuple(range(2**31 + i * 4096, 2**31 + i * 4096 + n))


def skeletons(workload: Workload) -> dict[str, tuple[int, ...]]:
    """Each request's whole prompt in token ids, a follow-up's built from its predecessor's
    prompt and an answer of the predecessor's `max_tokens` placeholder ids (the real one is
    only known once generated)."""
    out: dict[str, tuple[int, ...]] = {}
    index = {r.request_id: i for i, r in enumerate(workload.requests)}
    for r in workload.requests:
        if r.follows is None:
            out[r.request_id] = r.prompt_token_ids
        else:
            i = index[r.follows]
            out[r.request_id] = (out[r.follows] + _answer(i, workload.requests[i].max_tokens)
                                 + r.prompt_token_ids)
    return out


def reuse_ratio(workload: Workload, block_size: int) -> float:
    """Of all full prompt blocks, those an unlimited prefix cache would hit: a block hits when
    its whole prefix (chained hash) appeared in an earlier request, in arrival order; a
    follow-up turn comes after its predecessor, whose answer's blocks count as seen (an
    engine caches what it generated)."""
    seen: set[int] = set()
    hit = total = 0
    turns = any(r.follows for r in workload.requests)
    whole = skeletons(workload)
    ordered = workload.requests if turns else sorted(workload.requests,
                                                      key=lambda r: r.arrival_s)
    for i, r in enumerate(ordered):
        hashes = block_hashes(whole[r.request_id], block_size)
        if turns:  # its answer, as its follow-up will see it
            seen.update(block_hashes(whole[r.request_id] + _answer(i, r.max_tokens),
                                     block_size)[len(hashes):])
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        hit += k
        total += len(hashes)
        seen.update(hashes)
    return hit / total if total else 0.0


def _tokens(rng: np.random.Generator, n: int, vocab: Vocab) -> tuple[int, ...]:
    return tuple(rng.integers(vocab.lo, vocab.hi, size=n).tolist())


def _unique_rows(rng: np.random.Generator, n: int, width: int,
                 vocab: Vocab) -> list[tuple[int, ...]]:
    """`n` distinct token rows (redrawn on the rare collision)."""
    if vocab.size ** width < n:
        raise ValueError(f"{n} distinct {width}-token suffixes do not exist in a vocab of "
                         f"{vocab.size}")
    rows: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(rows) < n:
        row = _tokens(rng, width, vocab)
        if row not in seen:
            seen.add(row)
            rows.append(row)
    return rows


def renamed(workload: Workload, name: str, suffix: str) -> Workload:
    """`workload` under another name, every request id (and follow-up link) with `suffix`, so
    that runs of one workload at several rates can share a repetition's prompt table."""
    def rid(r: str | None) -> str | None:
        return None if r is None else r + suffix

    return replace(workload, name=name, requests=tuple(
        replace(r, request_id=rid(r.request_id), follows=rid(r.follows))
        for r in workload.requests))


def _poisson_arrivals(rng: np.random.Generator, n: int, rate_rps: float) -> list[float]:
    """`n` arrivals of a Poisson process at `rate_rps`, the first at 0.0."""
    _check_rate(rate_rps)
    gaps = rng.exponential(1.0 / rate_rps, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1: {v}")


def _check_rate(rate_rps: float) -> None:
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be positive: {rate_rps}")
