"""Each repetition's slowest first token through our arms, read from the conductor's own
timeline: where its time went, what the policy predicted and chose, and how busy the system
was when it was sent. A TTFT p99 over a few dozen requests is the worst one or two of them;
this is what says why.

The load generator sends every request to our arms with an `X-Request-Id` of its own
(`RequestRecord.sent_id`); the conductor logs it as `client_request_id` (`cmpl-<id>`) on the
request's `timeline` line, whose `request_id` joins its `routed` line.

The stages shown are the conductor's TTFT in parts: `conductor.timeline.BEFORE_RPCS`, then
the parts of the RPC the first token came through, the one with the shorter span
(`conductor.timeline.RPC_PARTS` says why). `other` is what the parts leave uncovered (the
first token's way out of the conductor) and `client` the client's TTFT beyond the
conductor's (its own connection, the server's first bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks import conductor_log
from benchmarks.e2e.report import RequestRecord
from conductor.timeline import BEFORE_RPCS, RPC_PARTS

_ROUTE = ("prefill", "decode", "predicted_ttft_s", "cached_blocks", "local_prefill")


@dataclass(frozen=True)
class Slowest:
    system: str
    workload: str
    rep: int
    record: RequestRecord
    in_flight: int
    """The run's requests sent before it and still streaming when it was sent."""
    fields: Mapping[str, str]
    """Its `timeline` and `routed` lines' fields; empty when the log has no such request."""

    @property
    def ttft_s(self) -> float:
        assert self.record.first_token_s is not None
        return self.record.first_token_s - self.record.sent_s

    def stages_ms(self) -> dict[str, float]:
        """The TTFT's parts in ms, `other` and `client` included; empty without a timeline."""
        if "ttft_ms" not in self.fields:
            return {}
        f = self.fields
        spans = {rpc: float(f[f"{rpc}_ms"]) for rpc in RPC_PARTS if f"{rpc}_ms" in f}
        via = RPC_PARTS[min(spans, key=spans.__getitem__)] if spans else ()
        out = {k: float(f[f"{k}_ms"]) for k in BEFORE_RPCS + via if f"{k}_ms" in f}
        ttft_ms = float(f["ttft_ms"])
        out["other"] = max(ttft_ms - sum(out.values()), 0.0)
        out["client"] = max(self.ttft_s * 1e3 - ttft_ms, 0.0)
        return out

    def as_json(self) -> dict:
        return {"system": self.system, "workload": self.workload, "rep": self.rep,
                "request_id": self.record.request_id, "ttft_s": self.ttft_s,
                "in_flight": self.in_flight, "stages_ms": self.stages_ms(),
                "fields": dict(self.fields)}


def read(path: Path) -> dict[str, dict[str, str]]:
    """Client id -> the fields of its request's `timeline` line, with the `routed` line's
    route and prediction added."""
    routed: dict[str, dict[str, str]] = {}
    timelines: dict[str, dict[str, str]] = {}
    for _, line in conductor_log.lines(path):
        event, kv = conductor_log.parse(line)
        if event == "routed":
            routed[kv.get("request_id", "")] = {k: kv[k] for k in _ROUTE if k in kv}
        elif event == "timeline" and kv.get("client_request_id", "").startswith("cmpl-"):
            timelines[kv["client_request_id"].removeprefix("cmpl-")] = kv
    return {cid: {**routed.get(kv.get("request_id", ""), {}), **kv}
            for cid, kv in timelines.items()}


def pick(system: str, workload: str, rep: int, records: Sequence[RequestRecord],
         fields: Mapping[str, Mapping[str, str]]) -> Slowest | None:
    """The run's request with the longest TTFT (None: no request had a first token)."""
    ok = [r for r in records if r.first_token_s is not None]
    if not ok:
        return None
    worst = max(ok, key=lambda r: r.first_token_s - r.sent_s)  # type: ignore[operator]
    busy = sum(1 for r in records if r is not worst and r.sent_s < worst.sent_s
               and (r.token_times_s[-1] if r.token_times_s else r.sent_s) > worst.sent_s)
    return Slowest(system, workload, rep, worst, busy, fields.get(worst.sent_id, {}))


def markdown(rows: Sequence[Slowest], top: int = 4) -> str:
    """One row per run: the request, its route and its `top` longest stages."""
    out = ["| system | workload | rep | TTFT (ms) | prompt tokens | in flight | route: prefill "
           "-> decode (cached blocks, predicted TTFT) | longest stages (ms) |",
           "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for w in rows:
        f = w.fields
        route = (f"{f.get('prefill', '?')} -> {f.get('decode', '?')} "
                 f"({f.get('cached_blocks', '?')}, {f.get('predicted_ttft_s', '?')} s)"
                 if f else "not in the log")
        stages = sorted(w.stages_ms().items(), key=lambda kv: -kv[1])[:top]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in stages) or "-"
        out.append(f"| {w.system} | {w.workload} | {w.rep + 1} | {w.ttft_s * 1e3:.0f} | "
                   f"{w.record.prompt_tokens} | {w.in_flight} | {route} | {parts} |")
    return "\n".join(out)
