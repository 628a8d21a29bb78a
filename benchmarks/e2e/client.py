"""The load generator: a workload's requests sent open-loop (each at its arrival time, whatever
the system's state), streamed, every token's arrival timed.

Prompts go as text (what users send, and what `vllm-router`'s cache-aware policy reads), the
same text to every system. Requests are greedy with `ignore_eos`, so every system generates the
same number of tokens. A non-200 answer (429 early rejection included), an error event in the
stream or a timeout makes the request failed, with the reason kept.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import httpx

from benchmarks.e2e.report import RequestRecord
from benchmarks.e2e.workloads import BenchRequest

REQUEST_TIMEOUT_S = 300.0


async def _one(client: httpx.AsyncClient, url: str, model: str, system: str, workload: str,
               req: BenchRequest, prompt: str, t0: float,
               answer: list[str] | None = None, id_prefix: str = "") -> RequestRecord:
    """One request, sent at its arrival time (now, for a follow-up turn), with an X-Request-Id
    of `id_prefix` + its id when a prefix is given; the text it generated is appended to
    `answer`."""
    delay = t0 + req.arrival_s - time.monotonic()
    if delay > 0 and req.follows is None:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    rec = RequestRecord(system=system, workload=workload, request_id=req.request_id, ok=False,
                        error=None, sent_s=sent - t0, first_token_s=None, token_times_s=[],
                        prompt_tokens=0, output_tokens=0,
                        sent_id=f"{id_prefix}{req.request_id}" if id_prefix else "")
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    try:
        headers = {"X-Request-Id": rec.sent_id} if rec.sent_id else None
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                                 timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {text[:200]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return rec
                now = time.monotonic() - t0
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))
                    if n and rec.first_token_s is None:
                        rec.first_token_s = now
                    rec.token_times_s.extend([now] * n)
                    if answer is not None:
                        answer.append(choice.get("text") or "")
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens") or 0
                    rec.output_tokens = usage.get("completion_tokens") or 0
    except (TimeoutError, httpx.HTTPError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec.output_tokens = rec.output_tokens or len(rec.token_times_s)
    rec.ok = rec.first_token_s is not None and rec.output_tokens == req.max_tokens
    if not rec.ok:
        rec.error = f"{rec.output_tokens} of {req.max_tokens} tokens"
    return rec


async def run(url: str, model: str, system: str, workload: str,
              requests: Sequence[BenchRequest], prompts: dict[str, str],
              on_done: Callable[[RequestRecord], None] | None = None,
              id_prefix: str = "") -> tuple[list[RequestRecord], float]:
    """Every request of the workload; the records and the run's wall time in seconds.

    A follow-up turn (`BenchRequest.follows`) waits for its predecessor, then `think_s`, and
    sends the predecessor's whole prompt text, the text it generated and its own question
    (`prompts[request_id]`), as a chat client would. With `id_prefix`, each request carries
    an X-Request-Id of the prefix and its id."""
    limits = httpx.Limits(max_connections=len(requests) + 4,
                          max_keepalive_connections=len(requests) + 4)
    done: dict[str, asyncio.Future[str]] = {
        r.request_id: asyncio.get_running_loop().create_future() for r in requests}
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic() + 0.05

        async def one(req: BenchRequest) -> RequestRecord:
            prompt = prompts[req.request_id]
            if req.follows is not None:
                prompt = await done[req.follows] + prompt
                await asyncio.sleep(req.think_s)
            answer: list[str] = []
            try:
                rec = await _one(client, url, model, system, workload, req, prompt, t0, answer,
                                 id_prefix)
            finally:  # its follow-up goes on (without the answer, if there is none)
                done[req.request_id].set_result(prompt + "".join(answer))
            if on_done is not None:
                on_done(rec)
            return rec
        records = await asyncio.gather(*(one(r) for r in requests))
        return list(records), time.monotonic() - t0
