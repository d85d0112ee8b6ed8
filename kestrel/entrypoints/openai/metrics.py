"""Prometheus metrics of the API server, named `kestrel:*` (issue 3).

Gauges and counters are read from the engine at scrape time, one series per engine core with an
`engine` label ("0", "1", ... as vLLM's): `AsyncLLM.core_stats` (each core's latest report) and
`AsyncLLM.core_counters` (cumulative). Latency histograms are observed by the server as requests
finish, over all cores. Each app has its own registry, so several servers can live in one process
(tests).

Beside vLLM's families, the engine steps (`engine_steps_total`, the requests and tokens in them,
`engine_busy_seconds_total`, `engine_step_seconds_total{phase}`), the KV pool in blocks, the
configuration (`*_config_info`, value 1, the settings as labels) and the API server process's CPU
(`process_cpu_seconds_total`): what `/dashboard` draws and `kestrel doctor` reads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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

# Engine-step counters: metric name (without _total) -> key of AsyncLLM.core_counters.
STEP_COUNTERS = {
    "engine_steps": ("steps", "Engine steps run."),
    "engine_step_requests": ("step_requests", "Requests in the engine steps, summed (over steps: the mean batch)."),
    "engine_step_tokens": ("step_tokens", "Tokens computed in the engine steps, summed."),
    "engine_busy_seconds": ("busy_s", "Wall time of the engine steps, from scheduling to outputs (seconds)."),
}
# Where a step's time went: phase label -> key of AsyncLLM.core_counters.
STEP_PHASES = {"schedule": "schedule_s", "prepare_inputs": "prepare_s", "forward": "forward_s", "sample": "sample_s"}

# Per-request histograms, as vLLM's: its n, and (1-2-5 up to max_model_len) its token counts.
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# Phases of a request from its first scheduling (prefill, decode, both: inference), as vLLM's.
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > limit:
                return out
            out.append(value)
        exponent += 1


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
        yield from self.collect_steps(labels, core_counters)
        iteration_tokens = getattr(self.engine, "iteration_tokens", None)
        if iteration_tokens is not None:
            h = HistogramMetricFamily(PREFIX + "iteration_tokens_total",
                                      "Tokens per engine step (prompt tokens computed plus tokens sampled).",
                                      labels=["model_name"])
            h.add_metric([self.model_name], iteration_tokens.cumulative(), float(iteration_tokens.sum))
            yield h
        config = getattr(self.engine, "config", None)
        if config is not None:
            yield from self.collect_kv_blocks(labels, core_stats)
            yield from self.collect_config_info(config)
            if config.speculative is not None:
                yield from self.collect_spec_decoding(labels)

    def collect_steps(self, labels: list[str], core_counters: list[dict[str, float]]):
        for name, (key, doc) in STEP_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for engine, counters in enumerate(core_counters):
                c.add_metric([self.model_name, str(engine)], float(counters.get(key, 0)))
            yield c
        c = CounterMetricFamily(PREFIX + "engine_step_seconds",
                                "Time of the engine steps by phase: scheduling, building inputs, forward, sampling "
                                "(seconds).", labels=labels + ["phase"])
        for engine, counters in enumerate(core_counters):
            for phase, key in STEP_PHASES.items():
                c.add_metric([self.model_name, str(engine), phase], float(counters.get(key, 0)))
        yield c

    def collect_kv_blocks(self, labels: list[str], core_stats: list):
        """The KV pool in blocks: in use (by running requests) and free (cached-but-unused ones included)."""
        g = GaugeMetricFamily(PREFIX + "kv_cache_blocks", "KV-cache blocks, by state (used, free).",
                              labels=labels + ["state"])
        for engine, total in enumerate(self.engine.core_num_kv_blocks):
            stats = core_stats[engine] if engine < len(core_stats) else None
            used = round(stats.kv_cache_usage * total) if stats is not None else 0
            g.add_metric([self.model_name, str(engine), "used"], float(used))
            g.add_metric([self.model_name, str(engine), "free"], float(total - used))
        yield g

    def quantization_label(self, config) -> str:
        """--quantization as given; unset, "gguf" for a GGUF file (its blocks, as vLLM labels any GGUF
        model: Kestrel keeps them where its kernels run them) and "none" for a Hugging Face folder."""
        if config.model.quantization is not None:
            return config.model.quantization
        source = getattr(self.engine, "source", None)
        return "gguf" if source is not None and source.gguf_file is not None else "none"

    def collect_config_info(self, config):
        """The settings a diagnosis points at, as labels of gauges of value 1 (as vLLM's cache_config_info)."""
        sched, cache, parallel = config.scheduler, config.cache, config.parallel
        infos = {
            "cache_config_info": {"block_size": cache.block_size, "enable_prefix_caching": cache.enable_prefix_caching,
                                  "kv_cache_dtype": cache.kv_cache_dtype,
                                  "num_gpu_blocks": sum(self.engine.core_num_kv_blocks)},
            "scheduler_config_info": {"max_num_seqs": sched.max_num_seqs,
                                      "max_num_batched_tokens": sched.max_num_batched_tokens,
                                      "max_model_len": sched.max_model_len,
                                      "enable_chunked_prefill": sched.enable_chunked_prefill,
                                      "async_scheduling": sched.async_scheduling},
            "model_config_info": {"dtype": str(config.model.dtype).removeprefix("torch."),
                                  "quantization": self.quantization_label(config),
                                  "enforce_eager": config.enforce_eager,
                                  "attention_backend": config.attention_backend,
                                  "device": str(config.device.device),
                                  "tensor_parallel_size": parallel.tensor_parallel_size,
                                  "pipeline_parallel_size": parallel.pipeline_parallel_size,
                                  "data_parallel_size": parallel.data_parallel_size},
        }
        for name, values in infos.items():
            g = GaugeMetricFamily(PREFIX + name, f"Configuration: {name.removesuffix('_info').replace('_', ' ')}.",
                                  labels=["model_name", *values])
            g.add_metric([self.model_name, *(str(v) for v in values.values())], 1.0)
            yield g

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
        ProcessCollector(registry=self.registry)  # this (API server) process: process_cpu_seconds_total, ...

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between successive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds",
                          "Time a request waited before it was first scheduled.")

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        config = getattr(engine, "config", None)
        max_len = config.model.max_model_len if config is not None else 1 << 20
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                       buckets_1_2_5(max_len))
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Tokens generated for each finished request.", buckets_1_2_5(max_len))
        self.params_n = histogram("request_params_n", "The n of each finished request.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of each finished request.",
                                           buckets_1_2_5(max_len))
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time from a request's first scheduling to its last token.",
                                        REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from a request's first scheduling to its first token.",
                                      REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from a request's first token to its last.", REQUEST_TIME_BUCKETS)
        from prometheus_client import Counter
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def observe_finished(self, metrics: RequestMetrics | None, num_output_tokens: int,
                         finish_reasons: list[str], num_prompt_tokens: int | None = None, n: int | None = None,
                         max_tokens: int | None = None) -> None:
        """Record one finished request (one choice set of one prompt)."""
        for reason in finish_reasons:
            self._success.labels(self.model_name, reason or "unknown").inc()
        if num_prompt_tokens is not None:
            self.prompt_tokens.observe(num_prompt_tokens)
            self.generation_tokens.observe(num_output_tokens)
        if n is not None:
            self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        if metrics is None:
            return
        self.observe_phases(metrics)
        arrival, first, done = metrics.arrival_time, metrics.first_token_time, metrics.finished_time
        if first is not None:
            self.ttft.observe(max(first - arrival, 0.0))
        if done is not None:
            self.e2e.observe(max(done - arrival, 0.0))
        if metrics.queue_time is not None:
            self.queue.observe(metrics.queue_time)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)

    def observe_phases(self, metrics: RequestMetrics) -> None:
        """Prefill (first scheduled to first token), decode (first to last token), and both."""
        first = metrics.first_token_time
        if first is None:
            return
        scheduled = metrics.arrival_time + (metrics.queue_time or 0.0)
        last = metrics.last_token_time or metrics.finished_time or first
        prefill, decode = max(first - scheduled, 0.0), max(last - first, 0.0)
        self.prefill_time.observe(prefill)
        self.decode_time.observe(decode)
        self.inference_time.observe(prefill + decode)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's `histogram_quantile` over cumulative (upper bound, count) buckets, +Inf last:
    linear within the bucket where the q-th observation falls; the highest finite bound when it falls
    in +Inf; None without observations."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
