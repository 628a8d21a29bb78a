"""The request set (deterministic greedy completions, some sharing prefixes, some with a
shared client id), the single-engine reference they are checked against, and one
request's run and classification."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.chaos.config import (
    BLOCK_SIZE,
    DTYPE,
    DUPLICATE_EVERY,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    REFERENCE_ENGINE,
)


@dataclass(frozen=True)
class Req:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    stream: bool
    group: str
    """prefix-<k> (shares a long prefix), unique, or repeat-<i> (an earlier request's prompt)."""


def build_requests(n: int, seed: int, vocab: int) -> list[Req]:
    """Deterministic for (n, seed, vocab): ~60% share one of four long prefixes (a unique
    tail each), ~30% unique prompts (some short enough to be prefilled on the decode
    instance), ~10% repeat an earlier prompt exactly. Half stream, alternating."""
    rng = random.Random(seed)
    lo, hi = 5, vocab - 5  # clear of the special tokens at the start of the vocabulary

    def ids(k: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(k)]

    prefixes = [ids(k) for k in (1536, 1024, 640, 320)]
    reqs: list[Req] = []
    for i in range(n):
        max_tokens = rng.randint(*MAX_TOKENS)
        r = rng.random()
        if r < 0.1 and reqs:
            src = reqs[rng.randrange(len(reqs))]
            prompt, group = src.prompt, f"repeat-{src.index}"
        elif r < 0.7:
            k = rng.randrange(len(prefixes))
            prompt, group = tuple(prefixes[k] + ids(rng.randint(8, 120))), f"prefix-{k}"
        else:
            length = rng.choice((rng.randint(8, 60), rng.randint(100, 1200)))
            prompt, group = tuple(ids(length)), "unique"
        assert len(prompt) + MAX_TOKENS[1] <= MAX_MODEL_LEN
        reqs.append(Req(i, prompt, max_tokens, stream=i % 2 == 1, group=group))
    return reqs


# ------------------------------------------------------------------ the reference


def reference(model: str, prompts: list[tuple[int, ...]], run_dir: Path,
              max_tokens: int = MAX_TOKENS[1], threads: int | None = None) -> dict:
    """prompt -> {"token_ids", "logprobs"} (`max_tokens` tokens; greedy, so a shorter
    request's output is a prefix), from one standalone engine. Cached in the run dir per
    prompt, under a hash of the model and engine settings: a rerun computes only new prompts.
    `threads`: the engine's OpenMP threads, those of the engines compared with it
    (tests/reference_engine.py says why)."""
    job = {"model": model, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
           "dtype": DTYPE, "max_tokens": max_tokens, "runner_up": True}
    if threads:
        job["threads"] = threads
    key = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]
    cache = run_dir / f"reference-{key}.json"

    def pkey(p: tuple[int, ...]) -> str:
        return hashlib.sha256(json.dumps(p).encode()).hexdigest()

    known: dict[str, dict] = json.loads(cache.read_text()) if cache.exists() else {}
    missing = [p for p in prompts if pkey(p) not in known]
    print(f"reference: {len(prompts) - len(missing)} of {len(prompts)} distinct prompts cached "
          f"in {cache}", flush=True)
    if missing:
        print(f"reference: {len(missing)} prompts on one standalone engine ...", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(REFERENCE_ENGINE)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(json.dumps({**job, "prompts": [list(p) for p in missing]}),
                                        timeout=3600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"reference engine failed ({proc.returncode}):\n{err[-4000:]}")
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        outs = json.loads(line.removeprefix("RESULT "))
        assert len(outs) == len(missing)
        known.update({pkey(p): o for p, o in zip(missing, outs, strict=True)})
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
        print(f"reference: done in {time.monotonic() - t0:.0f}s", flush=True)
    return {p: known[pkey(p)] for p in prompts}


# ------------------------------------------------------------------ one request


@dataclass
class Result:
    index: int
    stream: bool
    group: str
    cls: str = ""
    status: int = 0
    """HTTP status (0: none)."""
    detail: str = ""
    """Why it is not ok: the error message, or what differs."""
    t_start: float = 0.0
    t_end: float = 0.0
    ttft: float | None = None
    tokens: int = 0
    logprob_drift: float = 0.0
    """Largest |logprob - reference| over the tokens that match the reference."""
    decode_instance: str = ""
    refusal: str = ""
    """A 429's `Retry-After` and `x-kvcluster-reason` headers ("<seconds>/<reason>"; "" when
    either is missing)."""
    tie_at: int | None = None
    """ok by an exact tie: at this position the reference's best and runner-up tokens had
    equal logprobs (within TIE_EPS) and this output took the runner-up; greedy output past a
    tie is not defined by the model, only by float noise."""


def _error_message(body: object) -> str | None:
    """The message of an OpenAI error object, None if `body` is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) \
            and isinstance(body["error"].get("message"), str):
        return body["error"]["message"]
    return None


TIE_EPS = 1e-5
"""Logprobs this close are a tie (float32 noise between batch shapes is ~1e-6 here)."""


def _compare(res: Result, ids: list[int], lps: list[float | None], ref: dict,
             max_tokens: int) -> str | None:
    """What is wrong with a complete output (None: identical to the reference)."""
    want = ref["token_ids"][:max_tokens]
    res.tokens = len(ids)
    n = 0
    while n < min(len(ids), len(want)) and ids[n] == want[n]:
        n += 1
    drift = [abs(a - b) for a, b in zip(lps[:n], ref["logprobs"][:n], strict=False)
             if a is not None]
    res.logprob_drift = max(drift, default=0.0)
    if ids == want:
        return None
    if len(ids) == max_tokens and n < len(want) and "runner_up" in ref:
        alt, alt_lp = ref["runner_up"][n]
        if ids[n] == alt and abs(ref["logprobs"][n] - alt_lp) <= TIE_EPS:
            res.tie_at = n
            return None
    if len(ids) != max_tokens:
        return f"{len(ids)} tokens, asked {max_tokens} (first difference at {n})"
    return f"tokens differ from the reference from position {n}: {_difference(n, ids, lps, ref)}"


def _difference(n: int, ids: list[int], lps: list[float | None], ref: dict) -> str:
    """What came at position `n` against the reference's best and runner-up there: a logprob
    near the reference's says float noise, one far off says the KV the engine attended to."""
    got_lp = lps[n] if n < len(lps) else None
    out = f"got {ids[n]} (logprob {got_lp if got_lp is None else round(got_lp, 4)})"
    if n < len(ref["token_ids"]):
        out += f", reference {ref['token_ids'][n]} ({round(ref['logprobs'][n], 4)})"
    if "runner_up" in ref and n < len(ref["runner_up"]):
        alt, alt_lp = ref["runner_up"][n]
        out += f", its runner-up {alt} ({round(alt_lp, 4)})"
    return out


def run_one(client: httpx.Client, url: str, req: Req, ref: dict, deadline_s: float,
            t_base: float, slo_ms: float) -> Result:
    res = Result(req.index, req.stream, req.group)
    shared = req.index % DUPLICATE_EVERY < 2  # a pair sharing its client id
    client_id = f"chaos-dup-{req.index // DUPLICATE_EVERY}" if shared else f"chaos-{req.index}"
    body = {"prompt": list(req.prompt), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 1, "stream": req.stream,
            "request_id": client_id}
    if slo_ms > 0:  # admission by SLO off: a 429 from a slow shared CPU is not a fault's doing
        body["ttft_slo_ms"] = body["tbt_slo_ms"] = slo_ms
    t0 = time.monotonic()
    res.t_start = t0 - t_base
    timeout = httpx.Timeout(deadline_s, connect=10.0)
    try:
        if not req.stream:
            r = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
            res.status = r.status_code
            _refusal(res, r)
            try:
                payload = r.json()
            except ValueError:
                payload = None
            if r.status_code != 200:
                msg = _error_message(payload)
                res.cls = "clean_error" if msg is not None else "wrong"
                res.detail = msg if msg is not None else \
                    f"HTTP {r.status_code} without an OpenAI error body: {r.text[:200]!r}"
            else:
                try:
                    choice = payload["choices"][0]
                    ids = list(choice["token_ids"])
                    lps = list(choice["logprobs"]["token_logprobs"])
                    res.decode_instance = payload.get("kv_transfer", {}).get("decode_instance", "")
                except (TypeError, KeyError, IndexError) as e:
                    res.cls, res.detail = "wrong", f"200 with a malformed body ({e!r})"
                else:
                    why = _compare(res, ids, lps, ref, req.max_tokens)
                    res.cls, res.detail = ("ok", "") if why is None else ("wrong", why)
        else:
            _stream(client, url, body, req, ref, res, timeout, t0, deadline_s)
    except httpx.TimeoutException as e:
        res.cls, res.detail = "hung", f"no answer within {deadline_s:.0f}s ({type(e).__name__})"
    except httpx.HTTPError as e:
        if res.status == 200:  # the stream had started: it ended without [DONE]
            res.cls = "wrong"
            res.detail = f"stream broken without [DONE]: {type(e).__name__}: {e}"
        else:
            res.cls, res.detail = "lost", f"{type(e).__name__}: {e}"
    res.t_end = time.monotonic() - t_base
    return res


def _refusal(res: Result, r: httpx.Response) -> None:
    after, reason = r.headers.get("retry-after", ""), r.headers.get("x-kvcluster-reason", "")
    if r.status_code == 429 and after and reason:
        res.refusal = f"{after}/{reason}"


def _stream(client: httpx.Client, url: str, body: dict, req: Req, ref: dict, res: Result,
            timeout: httpx.Timeout, t0: float, deadline_s: float) -> None:
    ids: list[int] = []
    lps: list[float | None] = []
    errors: list[str] = []
    done = after_done = False
    bad_events: list[str] = []
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        res.status = r.status_code
        _refusal(res, r)
        if r.status_code != 200:
            r.read()
            try:
                msg = _error_message(r.json())
            except ValueError:
                msg = None
            res.cls = "clean_error" if msg is not None else "wrong"
            res.detail = msg if msg is not None else \
                f"HTTP {r.status_code} without an OpenAI error body: {r.text[:200]!r}"
            return
        for line in r.iter_lines():
            if time.monotonic() - t0 > deadline_s:
                raise httpx.ReadTimeout("stream still running at the deadline")
            if not line:
                continue
            if done:
                after_done = True
                continue
            if line == "data: [DONE]":
                done = True
                continue
            if not line.startswith("data: "):
                bad_events.append(line[:80])
                continue
            try:
                event = json.loads(line[6:])
            except ValueError:
                bad_events.append(line[:80])
                continue
            msg = _error_message(event)
            if msg is not None:
                errors.append(msg)
                continue
            for choice in event.get("choices") or ():
                new = list(choice.get("token_ids") or ())
                if new and res.ttft is None:
                    res.ttft = time.monotonic() - t0
                ids += new
                lp = choice.get("logprobs") or {}
                got = list(lp.get("token_logprobs") or ())
                lps += got + [None] * (len(new) - len(got))
    if not done:
        res.cls, res.detail = "wrong", f"stream ended without [DONE] after {len(ids)} tokens"
        _compare(res, ids, lps, ref, req.max_tokens)
        return
    if after_done or bad_events:
        res.cls = "wrong"
        res.detail = "events after [DONE]" if after_done else f"malformed event {bad_events[0]!r}"
        return
    if errors:
        # A clean error only if what was streamed before it is the reference's beginning.
        want = ref["token_ids"][:len(ids)]
        _compare(res, ids, lps, {"token_ids": want, "logprobs": ref["logprobs"]}, len(ids))
        if ids != want:
            res.cls = "wrong"
            res.detail = f"{len(ids)} tokens before the error event differ from the " \
                         f"reference: {errors[0]}"
        else:
            res.cls, res.detail = "clean_error", f"(stream, {len(ids)} tokens) {errors[0]}"
        return
    why = _compare(res, ids, lps, ref, req.max_tokens)
    res.cls, res.detail = ("ok", "") if why is None else ("wrong", why)


