"""Per-request traces (issue 20): each box's timed events on one clock, the time per box, and
`GET /v1/requests/{id}/trace` on a real server: chunked prefill, queueing, preemption, streaming,
several prompts, the ring's bound, and traces off."""

from __future__ import annotations

import json
import threading
import time

import httpx2 as httpx
import pytest

from kestrel.config import SchedulerConfig
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request
from kestrel.core.scheduler import Scheduler, StepTrace
from kestrel.engine.tracing import API_SERVER, ENGINE_CORE, RequestTrace, TraceStore
from kestrel.messages import StepTimings, TraceEvent
from kestrel.sampling_params import SamplingParams
from tests.core.test_scheduler import FakeWorker
from tests.support.server_process import Server, assert_error

MODEL = "SmolLM2-135M-Instruct"


# ---- the pieces --------------------------------------------------------------------------------------

def test_the_store_keeps_the_last_n_requests():
    store = TraceStore(2)
    for rid in ("a", "cmpl-x-0", "cmpl-x-1"):
        store.start(rid)
    assert store.get("a") is None and len(store) == 2
    assert [t.request_id for t in store.find("cmpl-x")] == ["cmpl-x-0", "cmpl-x-1"]
    assert store.find("cmpl") == [] and store.find("cmpl-x-0")[0].request_id == "cmpl-x-0"
    with pytest.raises(ValueError):
        TraceStore(0)


def test_time_in_each_box_adds_up_to_the_request_time():
    t = RequestTrace("r")
    ms = 1e-3
    t.add(API_SERVER, "received", 0.0)
    t.add(API_SERVER, "tokenized", 2 * ms)
    t.add(API_SERVER, "sent", 2.5 * ms)
    t.add(ENGINE_CORE, "queued", 3 * ms)
    step = dict(schedule_ms=0.5, prepare_ms=1.0, forward_ms=20.0, sample_ms=2.0)
    t.add_engine_events([TraceEvent("scheduled", 13 * ms, {"prefix_hit_tokens": 0}),
                         TraceEvent("step", 13 * ms, {"tokens": 40, "drafts": 0, **step}),
                         TraceEvent("preempted", 40 * ms),
                         TraceEvent("resumed", 60 * ms),
                         TraceEvent("step", 60 * ms, {"tokens": 41, "drafts": 0, **step}),
                         TraceEvent("step", 85 * ms, {"tokens": 1, "drafts": 0, **step}),
                         TraceEvent("finished", 110 * ms, {"reason": "length"})], engine=0)
    t.add(API_SERVER, "first_token", 84 * ms)
    t.add(API_SERVER, "completed", 111 * ms)
    t.add(API_SERVER, "last_byte", 112 * ms)
    boxes = t.time_in_boxes()
    assert boxes["scheduler"] == pytest.approx(10 + 20 + 3 * 0.5)      # queued 10 ms, preempted 20 ms, planning
    assert boxes["model_runner"] == pytest.approx(3 * 21.0)
    assert boxes["sampler"] == pytest.approx(3 * 2.0)
    assert boxes["api_server"] == pytest.approx(2 + 1 + 2)             # tokenizing, handing over, last outputs
    assert sum(boxes.values()) == pytest.approx(112)
    summary = t.summary()
    assert summary == {"ttft_ms": 84.0, "e2e_ms": 112.0, "queue_ms": 30.0, "steps": 3, "prefill_chunks": 2,
                       "preemptions": 1, "finished": True}
    events = t.to_dict()["events"]
    assert [e["t_ms"] for e in events] == sorted(e["t_ms"] for e in events)
    assert events[0]["name"] == "received" and events[-1]["name"] == "last_byte"


def test_the_scheduler_records_steps_only_with_traces_on():
    for on in (False, True):
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, trace_requests=on)
        sched = Scheduler(config, KVCacheManager(32, 4))
        sched.add_request(Request("a", list(range(10, 22)), SamplingParams(max_tokens=2), None))
        worker, traces = FakeWorker(4), []
        while sched.has_unfinished_requests():
            so = sched.schedule()
            ro = worker.execute(so)
            ro.timings = StepTimings(0.001, 0.01, 0.002)
            out = sched.update_from_output(so, ro, StepTrace(1.0, 0.0005) if on else None)
            traces.extend(e for o in out.outputs for e in (o.trace or ()))
        if not on:
            assert traces == []
            continue
        assert [e.name for e in traces] == ["scheduled", "step", "step", "step", "finished"]
        steps = [e.attrs for e in traces if e.name == "step"]
        assert [s["tokens"] for s in steps] == [8, 4, 1]  # two prefill chunks (the first without output), a decode
        assert steps[0]["forward_ms"] == 10.0 and steps[0]["schedule_ms"] == 0.5 and steps[0]["batch_requests"] == 1
        assert traces[-1].attrs == {"reason": "length", "output_tokens": 2}


# ---- through the server ------------------------------------------------------------------------------

FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--max-num-batched-tokens",
         "32", "--request-trace-buffer", "4"]
LONG = "Tell me about the history of the printing press in Europe and in East Asia, in a few sentences. " * 2


def trace_of(server: Server, response_id: str) -> dict:
    r = httpx.get(f"{server.url}/v1/requests/{response_id}/trace", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def names(request: dict) -> list[str]:
    return [e["name"] for e in request["events"]]


@pytest.fixture(scope="module")
def server():
    s = Server(*FLAGS, held=True)
    s.wait_ready()
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()


@pytest.mark.slow
def test_a_chat_request_traced_through_every_box(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 200, r.text
    body = r.json()
    trace = trace_of(server, body["id"])
    assert trace["id"] == body["id"] and trace["object"] == "request.trace"
    (request,) = trace["requests"]
    order = names(request)
    for earlier, later in [("received", "tokenized"), ("tokenized", "sent"), ("sent", "scheduled"),
                           ("scheduled", "step"), ("step", "finished"), ("first_token", "completed"),
                           ("completed", "response_built")]:
        assert order.index(earlier) < order.index(later), order
    assert "queued" in order and order[0] == "received"
    steps = [e for e in request["events"] if e["name"] == "step"]
    prompt_tokens, output_tokens = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    # Chunks of at most 32 tokens, then one decode per token after the first.
    assert sum(s["tokens"] for s in steps) == prompt_tokens + output_tokens - 1
    assert request["summary"]["prefill_chunks"] == -(-prompt_tokens // 32) >= 2
    assert all(s["forward_ms"] > 0 and s["batch_requests"] >= 1 and s["engine"] == 0 for s in steps)
    boxes, summary = request["boxes_ms"], request["summary"]
    assert set(boxes) == {"api_server", "scheduler", "model_runner", "sampler", "engine_core_other"}
    assert sum(boxes.values()) == pytest.approx(summary["e2e_ms"], abs=0.01)
    assert boxes["model_runner"] > boxes["sampler"] > 0 and 0 < summary["ttft_ms"] < summary["e2e_ms"]


@pytest.mark.slow
def test_queueing_and_preemption_show_in_the_scheduler_box():
    # 9 blocks of 16 tokens: two 60 + 60-token requests cannot both finish without one preempted.
    s = Server("--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "10", "--request-trace-buffer", "8",
               "--no-enable-prefix-caching", held=True)
    try:
        s.wait_ready()
        s.hold()
        bodies: list[dict] = []

        def send(seed: int) -> None:
            prompt = [100 + (seed * 37 + i * 11) % 30000 for i in range(60)]
            r = httpx.post(f"{s.url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            bodies.append(r.json())

        threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both queued while the engine core is held
        s.release()
        for t in threads:
            t.join()
        requests = [trace_of(s, b["id"])["requests"][0] for b in bodies]
        assert all(r["summary"]["queue_ms"] >= 300 for r in requests), [r["summary"] for r in requests]
        preempted = [r for r in requests if r["summary"]["preemptions"]]
        assert preempted, [r["summary"] for r in requests]
        assert "resumed" in names(preempted[0])
        assert preempted[0]["boxes_ms"]["scheduler"] >= preempted[0]["summary"]["queue_ms"]
    finally:
        s.stop()


@pytest.mark.slow
def test_streams_and_several_prompts(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": ["The capital of France is", "Hi"], "max_tokens": 4, "temperature": 0,
            "stream": True}) as r:
        first = None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first = first or json.loads(line[6:])["id"]
    trace = trace_of(server, first)
    assert [q["request_id"] for q in trace["requests"]] == [f"{first}-0", f"{first}-1"]
    assert all(names(q)[-1] == "last_byte" and q["summary"]["finished"] for q in trace["requests"])


@pytest.mark.slow
def test_unknown_or_dropped_ids(server):
    assert_error(httpx.get(f"{server.url}/v1/requests/chatcmpl-nope/trace"), 404, "NotFoundError",
                 "no trace of request", "last 4 requests")
    ids = []
    for _ in range(5):
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        ids.append(r.json()["id"])
    assert httpx.get(f"{server.url}/v1/requests/{ids[0]}/trace").status_code == 404  # the ring dropped it
    assert httpx.get(f"{server.url}/v1/requests/{ids[-1]}/trace").status_code == 200


# ---- OpenTelemetry ---------------------------------------------------------------------------------

def synthetic_trace() -> RequestTrace:
    t, ms = RequestTrace("chatcmpl-1"), 1e-3
    t.add(API_SERVER, "received", 100.0)
    t.add(API_SERVER, "tokenized", 100.0 + 2 * ms)
    t.add(ENGINE_CORE, "queued", 100.0 + 3 * ms)
    step = dict(schedule_ms=0.5, prepare_ms=1.0, forward_ms=20.0, sample_ms=2.0)
    t.add_engine_events([TraceEvent("scheduled", 100.0 + 13 * ms, {"prefix_hit_tokens": 16}),
                         TraceEvent("step", 100.0 + 13 * ms, {"tokens": 40, **step}),
                         TraceEvent("preempted", 100.0 + 40 * ms), TraceEvent("resumed", 100.0 + 60 * ms),
                         TraceEvent("step", 100.0 + 60 * ms, {"tokens": 41, **step}),
                         TraceEvent("finished", 100.0 + 90 * ms, {"reason": "stop"})], engine=0)
    t.add(API_SERVER, "completed", 100.0 + 95 * ms)
    return t


def test_a_trace_becomes_a_request_span_with_a_child_per_box():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kestrel.engine.otel import SpanExporter
    memory = InMemorySpanExporter()
    exporter = SpanExporter(SimpleSpanProcessor(memory), "m")
    exporter.export(synthetic_trace())
    spans = {s.name: s for s in memory.get_finished_spans()}
    root = spans["llm_request"]
    assert sorted(spans) == ["api_server.output", "api_server.tokenize", "engine_core.step", "llm_request",
                             "scheduler.queue", "scheduler.requeue"]
    assert sum(s.name == "engine_core.step" for s in memory.get_finished_spans()) == 2
    assert all(s.parent.span_id == root.context.span_id for s in memory.get_finished_spans() if s is not root)
    def duration_ms(span) -> float:
        return (span.end_time - span.start_time) / 1e6

    assert duration_ms(root) == pytest.approx(95, abs=1e-3)
    assert duration_ms(spans["scheduler.queue"]) == pytest.approx(10, abs=1e-3)
    assert duration_ms(spans["scheduler.requeue"]) == pytest.approx(20, abs=1e-3)
    assert duration_ms(spans["engine_core.step"]) == pytest.approx(23.5, abs=1e-3)
    assert root.attributes["gen_ai.request.id"] == "chatcmpl-1" and root.attributes["kestrel.preemptions"] == 1
    assert root.attributes["kestrel.box_ms.model_runner"] == pytest.approx(42.0)
    exporter.shutdown()


@pytest.mark.slow
def test_the_server_sends_spans_to_an_otlp_collector():
    import http.server

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    received: list[ExportTraceServiceRequest] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces"
            received.append(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    s = Server("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
               "--otlp-traces-endpoint", f"http://127.0.0.1:{collector.server_port}",
               env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        s.wait_ready()
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        spans = []
        while time.monotonic() < deadline and not any(sp.name == "llm_request" for sp in spans):
            time.sleep(0.1)
            spans = [sp for req in received for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
        roots = [sp for sp in spans if sp.name == "llm_request"]
        assert roots, [sp.name for sp in spans]
        ids = {a.key: a.value.string_value for a in roots[0].attributes if a.key == "gen_ai.request.id"}
        assert ids == {"gen_ai.request.id": r.json()["id"]}
        assert sum(sp.name == "engine_core.step" for sp in spans) >= 4  # the prefill and 3 decodes
        assert {sp.parent_span_id for sp in spans if sp.name != "llm_request"} == {roots[0].span_id}
        # This server keeps no traces and has no profiler folder: both say how to turn them on.
        assert_error(httpx.get(f"{s.url}/v1/requests/{r.json()['id']}/trace"), 404, "NotFoundError",
                     "request traces are off", "--request-trace-buffer")
        assert_error(httpx.post(f"{s.url}/start_profile"), 404, "NotFoundError", "--torch-profiler-dir")
    finally:
        s.stop()
        collector.shutdown()
    assert s.proc.returncode == 0, s.output()


# ---- profiling -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_start_and_stop_profile_write_a_torch_trace(tmp_path):
    folder = tmp_path / "profiles"
    s = Server("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
               "--torch-profiler-dir", str(folder))
    try:
        s.wait_ready()
        assert httpx.post(f"{s.url}/start_profile").status_code == 200
        r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert httpx.post(f"{s.url}/stop_profile").status_code == 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(folder.glob("*.pt.trace.json*")):
            time.sleep(0.2)
        (trace_file,) = folder.glob("*.pt.trace.json*")
        assert trace_file.name.startswith("kestrel_rank0")
        import gzip
        text = (gzip.open if trace_file.suffix == ".gz" else open)(trace_file, "rt").read()
        assert '"traceEvents"' in text and "aten::" in text  # the model's ops were recorded
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.output()
