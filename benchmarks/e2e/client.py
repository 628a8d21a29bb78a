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
               req: BenchRequest, prompt: str, t0: float) -> RequestRecord:
    delay = t0 + req.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    rec = RequestRecord(system=system, workload=workload, request_id=req.request_id, ok=False,
                        error=None, sent_s=sent - t0, first_token_s=None, token_times_s=[],
                        prompt_tokens=0, output_tokens=0)
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
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
              ) -> tuple[list[RequestRecord], float]:
    """Every request of the workload; the records and the run's wall time in seconds."""
    limits = httpx.Limits(max_connections=len(requests) + 4,
                          max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.monotonic() + 0.05

        async def one(req: BenchRequest) -> RequestRecord:
            rec = await _one(client, url, model, system, workload, req, prompts[req.request_id], t0)
            if on_done is not None:
                on_done(rec)
            return rec
        records = await asyncio.gather(*(one(r) for r in requests))
        return list(records), time.monotonic() - t0
