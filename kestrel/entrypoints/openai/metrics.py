"""Prometheus metrics of the API server, named `kestrel:*` (issue 3).

Gauges and counters are read from the engine at scrape time, one series per engine core with an
`engine` label ("0", "1", ... as vLLM's): `AsyncLLM.core_stats` (each core's latest report) and
`AsyncLLM.core_counters` (cumulative). Latency histograms are observed by the server as requests
finish, over all cores. Each app has its own registry, so several servers can live in one process
(tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kestrel.outputs import RequestMetrics

PREFIX = "kestrel:"

# Engine-derived counters: metric name (without _total) -> key of AsyncLLM.core_counters.
ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens computed (prefill)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("preemptions", "Requests preempted to free KV-cache blocks."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
}

SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Drafts verified (one per request and step with draft tokens).", "num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector:
    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        labels = ["model_name", "engine"]
        core_stats = getattr(self.engine, "core_stats", None) or []
        gauges = (("num_requests_running", "Requests in the running batch.", "num_running_reqs"),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_reqs"),
                  ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_cache_usage"))
        for name, doc, field in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for engine, stats in enumerate(core_stats):
                g.add_metric([self.model_name, str(engine)], float(getattr(stats, field)) if stats is not None else 0.0)
            yield g
        core_counters = getattr(self.engine, "core_counters", None) or []
        for name, (key, doc) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for engine, counters in enumerate(core_counters):
                c.add_metric([self.model_name, str(engine)], float(counters.get(key, 0)))
            yield c
        if getattr(getattr(self.engine, "config", None), "speculative", None) is not None:
            yield from self.collect_spec_decoding(labels)

    def collect_spec_decoding(self, labels: list[str]):
        """vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens (also by position)."""
        per_core = self.engine.core_spec_decoding
        for name, doc, field in SPEC_DECODE_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for engine, stats in enumerate(per_core):
                c.add_metric([self.model_name, str(engine)], float(getattr(stats, field)))
            yield c
        c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens, by position in the draft.", labels=labels + ["position"])
        k = self.engine.config.speculative.num_speculative_tokens
        for engine, stats in enumerate(per_core):
            per_pos = stats.num_accepted_tokens_per_pos
            for position in range(k):
                c.add_metric([self.model_name, str(engine), str(position)],
                             float(per_pos[position] if position < len(per_pos) else 0))
        yield c


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between successive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds",
                          "Time a request waited before it was first scheduled.")
        from prometheus_client import Counter
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def observe_finished(self, metrics: RequestMetrics | None, num_output_tokens: int,
                         finish_reasons: list[str]) -> None:
        """Record one finished request (one choice set of one prompt)."""
        for reason in finish_reasons:
            self._success.labels(self.model_name, reason or "unknown").inc()
        if metrics is None:
            return
        arrival, first, done = metrics.arrival_time, metrics.first_token_time, metrics.finished_time
        if first is not None:
            self.ttft.observe(max(first - arrival, 0.0))
        if done is not None:
            self.e2e.observe(max(done - arrival, 0.0))
        if metrics.queue_time is not None:
            self.queue.observe(metrics.queue_time)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
