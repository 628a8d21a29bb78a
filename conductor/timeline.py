"""Where one request's time goes: marks on the conductor's clock, the engines' own stage times
(`worker_pb2.EngineTimes`), exported as the `kvcluster_stage_seconds{stage}` histogram, one
`timeline` log line per request, and OpenTelemetry spans (`conductor.tracing`) when a tracer
is configured.

Every mark and engine time is wall-clock Unix seconds: on one host the conductor's and the
workers' clocks agree; across hosts the engine sub-spans are placed with the skew between
them (the durations do not depend on it: each is taken on one clock).

The stages (seconds; a stage that did not happen is absent):

- `accept`: arrival (the ASGI app's first look at the request, `conductor.arrival`) to the
  endpoint's handler: API-key check, routing, FastAPI;
- `parse`: from there to validated, rendered, tokenized and hashed;
- `route`: from there to the policy's choice;
- `prefill`: the Prefill RPC, sent to reply: `prefill_send` (to the engine's scheduler:
  transport, the worker, and the rest of the engine's step in progress, since vLLM's engine
  core takes in new requests between steps), the prefill engine's `prefill_queue` (to its
  forward pass) and `prefill_compute` (forward pass to the sampled token), and
  `prefill_return` (from there to the reply's arrival: waiting for saves, transport);
- `decode_start`: the Generate RPC, sent to its first chunk: `decode_send` (as
  `prefill_send`), then `kv_wait`
  (held by the worker until the prefill beside it computed, then the engine's pool load
  waiting for the blocks still being written),
  `kv_load` (copying blocks from the pool), `decode_queue` (the rest of its wait for a
  forward pass), `decode_compute` (forward pass to the first token), and `decode_return`
  (from there to the chunk's arrival);
- `ttft`: arrival to the first token leaving the conductor; `decode`: first to last token;
- `answer`: last token to the response's last bytes handed to the server (the end of the
  stream, or the whole JSON answer built and written).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from protos import worker_pb2

BEFORE_RPCS = ("accept", "parse", "route")
"""The conductor's stages before it sends an RPC, one after the other."""
RPC_PARTS = {"prefill": ("prefill_send", "prefill_queue", "prefill_compute", "prefill_return"),
             "decode_start": ("decode_send", "kv_wait", "kv_load", "decode_queue",
                              "decode_compute", "decode_return")}
"""Each RPC's span and the parts it splits into. A disaggregated request's two RPCs run side by
side (its Generate waits in `kv_wait` meanwhile): its first token comes through the one with
the shorter span, and only that one's parts add up to its time."""
STAGES = (BEFORE_RPCS + tuple(s for rpc, parts in RPC_PARTS.items() for s in (rpc, *parts))
          + ("ttft", "decode", "answer"))


class Timeline:
    """One request's marks (conductor clock) and engine times. Cheap: a dict of floats."""

    __slots__ = ("marks", "prefill", "decode", "attrs")

    def __init__(self, received: float | None = None) -> None:
        self.marks: dict[str, float] = {"received": received or time.time()}
        self.prefill: worker_pb2.EngineTimes | None = None
        self.decode: worker_pb2.EngineTimes | None = None
        self.attrs: dict[str, str | int | float | bool] = {}
        """What the spans and the log line say about the request (route, instances, ...)."""

    def mark(self, name: str, at: float | None = None) -> None:
        """Record `name` now (the latest wins: a retried stage counts its last attempt)."""
        self.marks[name] = at or time.time()

    def mark_once(self, name: str) -> None:
        if name not in self.marks:
            self.marks[name] = time.time()

    def engine(self, role: str, times: worker_pb2.EngineTimes) -> None:
        """An engine's times for this request; fields it left 0 keep what was known."""
        old = self.prefill if role == "prefill" else self.decode
        if old is not None:
            merged = worker_pb2.EngineTimes()
            merged.CopyFrom(old)
            for field, value in times.ListFields():
                setattr(merged, field.name, value)
            times = merged
        if role == "prefill":
            self.prefill = times
        else:
            self.decode = times

    @property
    def parse_from(self) -> str:
        """The mark `parse` starts at: the handler's first look (`accepted`), else the arrival
        (`received`: a request that failed before its handler marked it)."""
        return "accepted" if "accepted" in self.marks else "received"

    def stages(self) -> dict[str, float]:
        m = self.marks
        out: dict[str, float] = {}
        _span(out, "accept", m, "received", "accepted")
        _span(out, "parse", m, self.parse_from, "prepared")
        _span(out, "route", m, "prepared", "routed")
        _span(out, "prefill", m, "prefill_sent", "prefill_done")
        _span(out, "decode_start", m, "decode_sent", "first_chunk")
        _span(out, "ttft", m, "received", "first_token")
        _span(out, "decode", m, "first_token", "last_token")
        _span(out, "answer", m, "last_token", "answered")
        _engine(out, "prefill", self.prefill, m.get("prefill_sent"), m.get("prefill_done"))
        _engine(out, "decode", self.decode, m.get("decode_sent"), m.get("first_chunk"))
        return out


def _engine(out: dict[str, float], role: str, e: worker_pb2.EngineTimes | None,
            sent: float | None, back: float | None) -> None:
    """An RPC's time split at the engine's marks: send, (pool,) queue, compute, return."""
    if e is None or not e.queued:
        return
    if sent is not None:
        out[f"{role}_send"] = max(e.queued - sent - e.held, 0.0)
    pool = e.kv_wait + e.kv_load
    if pool or e.held:
        out["kv_wait"] = e.held + e.kv_wait
        out["kv_load"] = e.kv_load
    if e.scheduled:
        out[f"{role}_queue"] = max(e.scheduled - e.queued - pool, 0.0)
        if e.first_token:
            out[f"{role}_compute"] = max(e.first_token - e.scheduled, 0.0)
            if back is not None:
                out[f"{role}_return"] = max(back - e.first_token, 0.0)


def _span(out: dict[str, float], name: str, marks: Mapping[str, float], a: str, b: str) -> None:
    if a in marks and b in marks:
        out[name] = max(marks[b] - marks[a], 0.0)


Sink = Callable[[Timeline, Mapping[str, float]], None]
"""Where a finished timeline goes (the histogram, the log, the tracer), with its stages."""
