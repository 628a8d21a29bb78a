"""A request's timeline as OpenTelemetry spans (the standard SDK), built once the request ends.

Off unless configured: `--otel-endpoint` (an OTLP/gRPC collector, e.g. http://127.0.0.1:4317)
or the SDK's own `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_TRACES_EXPORTER` environment. A W3C
`traceparent` header from the client makes the request's span a child of the caller's.

Spans (all ended, with the times of `conductor.timeline.Timeline`): `request` (server), with
`parse`, `route`, `prefill` (client: the Prefill RPC, with the prefill engine's
`engine.queue` and `engine.compute`) and `decode` (client: the Generate RPC, with the decode
engine's `kv.hold` (held by the worker for the prefill beside it), `engine.queue`, `kv.wait`,
`kv.load`, `engine.compute`, and a `first_token` event).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import structlog
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from conductor.timeline import Timeline
from protos import worker_pb2

log = structlog.get_logger(__name__)


def _ns(t: float) -> int:
    return int(t * 1e9)


class Tracing:
    """Turns finished timelines into spans through one `TracerProvider`."""

    def __init__(self, processor: SpanProcessor, service: str = "kvcluster-conductor") -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvcluster.conductor")

    @classmethod
    def from_config(cls, endpoint: str) -> Tracing | None:
        """OTLP/gRPC to `endpoint`, else whatever the SDK's environment asks; None: off."""
        env = os.environ
        endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "") \
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        kind = env.get("OTEL_TRACES_EXPORTER", "otlp" if endpoint else "none")
        if kind == "none":
            return None
        if kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint or None)
        log.info("tracing_on", exporter=kind, endpoint=endpoint)
        return cls(BatchSpanProcessor(exporter))

    @staticmethod
    def parent(headers: Mapping[str, str]) -> Context | None:
        """The caller's trace context (W3C `traceparent`), if it sent one."""
        if "traceparent" not in headers:
            return None
        return propagate.extract(headers)

    def export(self, tl: Timeline, status: int | str, parent: Context | None = None) -> None:
        m = tl.marks
        end = max(m.values())
        t = self.tracer
        root = t.start_span("request", context=parent, kind=SpanKind.SERVER,
                            start_time=_ns(m["received"]), attributes=dict(tl.attrs))
        root.set_attribute("http.response.status_code", str(status))
        if str(status) != "200":
            root.set_status(Status(StatusCode.ERROR))
        ctx = trace.set_span_in_context(root)
        self._child("accept", ctx, m.get("received"), m.get("accepted"))
        self._child("parse", ctx, m.get(tl.parse_from), m.get("prepared"))
        self._child("route", ctx, m.get("prepared"), m.get("routed"))
        if "prefill_sent" in m:
            span = t.start_span("prefill", context=ctx, kind=SpanKind.CLIENT,
                                start_time=_ns(m["prefill_sent"]))
            if tl.prefill is not None:
                self._engine(trace.set_span_in_context(span), tl.prefill)
            span.end(end_time=_ns(m.get("prefill_done", end)))
        if "decode_sent" in m:
            span = t.start_span("decode", context=ctx, kind=SpanKind.CLIENT,
                                start_time=_ns(m["decode_sent"]))
            if "first_token" in m:
                span.add_event("first_token", timestamp=_ns(m["first_token"]))
            if tl.decode is not None:
                self._engine(trace.set_span_in_context(span), tl.decode)
            span.end(end_time=_ns(m.get("last_token", end)))
        root.end(end_time=_ns(end))

    def _engine(self, ctx: Context, e: worker_pb2.EngineTimes) -> None:
        if not e.queued:
            return
        if e.held:
            self._child("kv.hold", ctx, e.queued - e.held, e.queued)
        at = e.queued
        if e.kv_wait or e.kv_load:
            self._child("kv.wait", ctx, at, at + e.kv_wait)
            self._child("kv.load", ctx, at + e.kv_wait, at + e.kv_wait + e.kv_load)
            at += e.kv_wait + e.kv_load
        self._child("engine.queue", ctx, at, e.scheduled or None)
        self._child("engine.compute", ctx, e.scheduled or None, e.first_token or None)

    def _child(self, name: str, ctx: Context, start: float | None, end: float | None) -> None:
        if start is None or end is None:
            return
        self.tracer.start_span(name, context=ctx, start_time=_ns(start)).end(
            end_time=_ns(max(end, start)))

    def shutdown(self) -> None:
        self.provider.shutdown()
