"""Request traces as OpenTelemetry spans (`--otlp-traces-endpoint`, as vLLM names it).

A finished request's trace (kestrel/engine/tracing.py) becomes one `llm_request` span from its arrival
to its last event, with a child span per stretch of time in a box: `api_server.tokenize`,
`scheduler.queue` (and `scheduler.requeue` after each preemption), one `engine_core.step` per step
(its batch and time split as attributes), `api_server.output` (from the engine core's last event to
the last byte). Exported over OTLP/HTTP (protobuf) in a background batch.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import set_span_in_context

from kestrel.engine.tracing import RequestTrace


def otlp_span_processor(endpoint: str) -> SpanProcessor:
    """Spans batched and sent to an OTLP/HTTP collector (`endpoint`: its base URL or its
    /v1/traces URL)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
    return BatchSpanProcessor(OTLPSpanExporter(endpoint=url))


class SpanExporter:
    def __init__(self, processor: SpanProcessor, model_name: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kestrel"}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kestrel")
        self.model_name = model_name
        # monotonic → Unix nanoseconds; the offset is taken once (the clocks do not drift apart in a run).
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def export(self, trace: RequestTrace, attributes: dict[str, Any] | None = None) -> None:
        events = sorted(trace.events, key=lambda e: e[2])
        if not events:
            return
        first = {name: t for _, name, t, _ in reversed(events)}
        start, end = first.get("received", events[0][2]), events[-1][2]
        summary = trace.summary()
        root = self.tracer.start_span("llm_request", start_time=self._ns(start), attributes={
            "gen_ai.request.id": trace.request_id, "gen_ai.request.model": self.model_name,
            "kestrel.queue_ms": summary["queue_ms"], "kestrel.steps": summary["steps"],
            "kestrel.preemptions": summary["preemptions"], **(attributes or {}),
            **{f"kestrel.box_ms.{box}": ms for box, ms in trace.time_in_boxes().items()}})
        context = set_span_in_context(root)

        def child(name: str, begin: float, finish: float, **attrs: Any) -> None:
            span = self.tracer.start_span(name, context=context, start_time=self._ns(begin), attributes=attrs)
            span.end(end_time=self._ns(max(finish, begin)))

        if "tokenized" in first:
            child("api_server.tokenize", start, first["tokenized"])
        waiting_since = None
        for _, name, t, attrs in events:
            if name in ("queued", "preempted"):
                waiting_since = (name, t)
            elif name in ("scheduled", "resumed") and waiting_since is not None:
                child("scheduler.queue" if waiting_since[0] == "queued" else "scheduler.requeue", waiting_since[1], t,
                      **{k: v for k, v in attrs.items() if isinstance(v, int | float | str)})
                waiting_since = None
            elif name == "step":  # `t` is where its scheduling ended and its worker's part began
                work = sum(attrs.get(k, 0.0) for k in ("prepare_ms", "forward_ms", "sample_ms"))
                child("engine_core.step", t - attrs.get("schedule_ms", 0.0) / 1e3, t + work / 1e3, **attrs)
        engine_end = max((t for box, _, t, _ in events if box == "engine_core"), default=None)
        if engine_end is not None and end > engine_end:
            child("api_server.output", engine_end, end)
        root.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()
