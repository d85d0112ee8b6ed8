"""`GET /dashboard`: the map of the design doc, live: the API server, each engine core (its scheduler
and KV-cache manager) and its workers (model runner, sampler) as boxes, each with its figures, and the
last requests, whose traces open as a waterfall across the boxes.

The page is one file of plain HTML, JavaScript and SVG (static/dashboard.html, no build step and
nothing fetched from outside the machine). It reads:

    GET /dashboard/events    server-sent events: a `snapshot()` every UPDATE_INTERVAL_S
    GET /v1/requests         the last requests with a trace (--request-trace-buffer N)
    GET /v1/requests/{id}/trace

A snapshot is read from the server's Prometheus registry, the same samples `/metrics` renders, so
every figure on the page is one of `/metrics` (totals as they are; percentiles by Prometheus's
`histogram_quantile`). Rates (tokens/s, steps/s, busy and CPU fractions, the step-time split) are
the page's differences between two snapshots.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from kestrel.entrypoints.openai.metrics import PREFIX, STEP_PHASES, ServerMetrics, histogram_quantile
from kestrel.entrypoints.openai.openapi import error_responses
from kestrel.entrypoints.openai.protocol import RecentRequestList

UPDATE_INTERVAL_S = 0.5
QUANTILES = (0.5, 0.9, 0.99)
HISTOGRAMS = {"ttft_s": "time_to_first_token_seconds", "tpot_s": "inter_token_latency_seconds",
              "e2e_s": "e2e_request_latency_seconds", "queue_s": "request_queue_time_seconds"}
ENGINE_GAUGES = {"running": "num_requests_running", "waiting": "num_requests_waiting",
                 "kv_usage": "kv_cache_usage_perc"}
ENGINE_COUNTERS = {"prompt_tokens_total": "prompt_tokens_total",
                   "generation_tokens_total": "generation_tokens_total",
                   "preemptions_total": "num_preemptions_total",
                   "prefix_cache_queries_total": "prefix_cache_queries_total",
                   "prefix_cache_hits_total": "prefix_cache_hits_total",
                   "steps_total": "engine_steps_total",
                   "step_requests_total": "engine_step_requests_total",
                   "step_tokens_total": "engine_step_tokens_total",
                   "busy_seconds_total": "engine_busy_seconds_total"}
Samples = dict[str, list[tuple[dict[str, str], float]]]


def collect_samples(metrics: ServerMetrics) -> Samples:
    """Every sample of the server's registry (what /metrics renders), by sample name."""
    samples: Samples = defaultdict(list)
    for family in metrics.registry.collect():
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def _sum(samples: Samples, name: str, **match: str) -> float:
    return sum(v for labels, v in samples.get(name, ()) if all(labels.get(k) == m for k, m in match.items()))


def _quantiles(samples: Samples, name: str) -> dict[str, float | None]:
    buckets = [(float(labels["le"]), v) for labels, v in samples.get(PREFIX + name + "_bucket", ())]
    out: dict[str, float | None] = {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}
    out["count"] = _sum(samples, PREFIX + name + "_count")
    return out


def _info(samples: Samples, name: str) -> dict[str, str]:
    rows = samples.get(PREFIX + name, ())
    return {k: v for k, v in rows[0][0].items() if k != "model_name"} if rows else {}


def snapshot(engine, metrics: ServerMetrics) -> dict[str, Any]:
    """The figures of every box, as /metrics has them now."""
    samples = collect_samples(metrics)
    engines = sorted({labels["engine"] for labels, _ in samples.get(PREFIX + "num_requests_running", ())}, key=int)
    return {
        "time": time.time(),
        "model": metrics.model_name,
        "config": {**_info(samples, "model_config_info"), **_info(samples, "scheduler_config_info"),
                   **_info(samples, "cache_config_info")},
        "traces": engine.traces.capacity if getattr(engine, "traces", None) is not None else None,
        "api_server": {
            "open_requests": getattr(engine, "num_open_requests", 0),
            "cpu_seconds_total": _sum(samples, "process_cpu_seconds_total"),
            "requests_finished_total": _sum(samples, PREFIX + "request_success_total"),
            **{key: _quantiles(samples, name) for key, name in HISTOGRAMS.items()},
        },
        "engines": [_engine_figures(samples, e) for e in engines],
    }


def _engine_figures(samples: Samples, engine: str) -> dict[str, Any]:
    figures: dict[str, Any] = {"engine": engine}
    for key, name in ENGINE_GAUGES.items():
        figures[key] = _sum(samples, PREFIX + name, engine=engine)
    for key, name in ENGINE_COUNTERS.items():
        figures[key] = _sum(samples, PREFIX + name, engine=engine)
    for state in ("used", "free"):
        figures[f"kv_blocks_{state}"] = _sum(samples, PREFIX + "kv_cache_blocks", engine=engine, state=state)
    figures["phase_seconds_total"] = {phase: _sum(samples, PREFIX + "engine_step_seconds_total", engine=engine,
                                                  phase=phase) for phase in STEP_PHASES}
    return figures


def request_list(engine, limit: int) -> dict[str, Any]:
    """The last `limit` traced requests, newest first, with their summaries."""
    traces = getattr(engine, "traces", None)
    if traces is None:
        return {"object": "list", "traces": False, "data": []}
    data = []
    for trace in traces.recent(limit):
        data.append({"id": trace.request_id, **trace.summary(), "boxes_ms": trace.time_in_boxes()})
    return {"object": "list", "traces": True, "data": data}


def dashboard_router(engine, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()
    page = resources.files("kestrel.entrypoints.openai").joinpath("static/dashboard.html").read_text()

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @router.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> StreamingResponse:
        async def events():
            while not await request.is_disconnected():
                yield f"data: {json.dumps(snapshot(engine, metrics))}\n\n"
                await asyncio.sleep(UPDATE_INTERVAL_S)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.get("/v1/requests", response_model=None,
                responses={200: {"model": RecentRequestList}, **error_responses(400, 401)})
    async def recent_requests(limit: int = 50) -> dict[str, Any]:
        """The last requests the server keeps traces of (--request-trace-buffer N), newest first."""
        return request_list(engine, min(max(limit, 0), 1000))

    return router
