"""`kestrel doctor [URL]`: which box of the map limits a running server, with the evidence and the flag
to change.

It reads the server's /metrics twice, `--window` seconds apart (the server must be under the load in
question meanwhile), and its last request traces when it keeps them (--request-trace-buffer N), then
checks the symptoms of the design doc's map, first match first:

    the engine idles while the API server's CPU is saturated   -> front end (tokenize, detokenize, stream)
    requests wait, KV blocks nearly all used, preemptions      -> KV-cache memory
    requests wait with KV blocks free                          -> scheduler limits
    long prompts take several prefill chunks before a token    -> the chunked-prefill budget
    the engine is busy with small batches                      -> model runner (forward, logits, sampling)

Every figure it prints is a difference of two readings of /metrics (rates over the window) or a
reading itself; nothing is sampled from the server's process.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from kestrel.entrypoints.openai.metrics import PREFIX, histogram_quantile

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_WINDOW_S = 5.0
# Thresholds of the symptoms.
FRONT_END_CPU = 0.7       # of one core, the API server process
ENGINE_IDLE_BUSY = 0.5    # the engine steps less than half the time
KV_FULL = 0.85            # of the KV blocks in use
KV_ROOMY = 0.6
SMALL_BATCH = 4.0         # requests per step
BUSY_ENGINE = 0.6
QUEUED_S = 0.05           # a queue time that is queueing


@dataclass
class Reading:
    """One scrape of /metrics: every sample by name, and when it was taken."""
    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]]

    @classmethod
    def parse(cls, text: str, at: float) -> Reading:
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((s.labels, s.value))
        return cls(at, samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples named `name` (the `kestrel:` prefix added) that carry `labels`."""
        full = name if name.startswith("process_") else PREFIX + name
        return sum(v for lab, v in self.samples.get(full, ()) if all(lab.get(k) == x for k, x in labels.items()))

    def info(self, name: str) -> dict[str, str]:
        rows = self.samples.get(PREFIX + name, ())
        return dict(rows[0][0]) if rows else {}

    def buckets(self, name: str) -> dict[float, float]:
        return {float(lab["le"]): v for lab, v in self.samples.get(PREFIX + name + "_bucket", ())}


@dataclass
class Figures:
    """What the window shows (rates per second, means per step, quantiles in seconds)."""
    seconds: float
    waiting: float
    running: float
    kv_usage: float
    preemptions: float
    requests_finished: float
    prompt_tokens: float
    generation_tokens: float
    steps: float
    batch: float | None            # requests per step
    tokens_per_step: float | None
    step_ms: float | None
    phase_ms: dict[str, float]     # schedule, prepare_inputs, forward, sample: per step
    engine_busy: float             # fraction of the window the engine stepped
    api_cpu: float                 # the API server process's CPU, in cores
    ttft_p50: float | None
    itl_p50: float | None
    queue_p50: float | None
    config: dict[str, str] = field(default_factory=dict)


def window_quantile(before: Reading, after: Reading, name: str, q: float = 0.5) -> float | None:
    """The quantile of what was observed between the two readings (the buckets' differences)."""
    b, a = before.buckets(name), after.buckets(name)
    return histogram_quantile(q, [(le, count - b.get(le, 0.0)) for le, count in a.items()])


def figures_of(before: Reading, after: Reading) -> Figures:
    dt = max(after.at - before.at, 1e-9)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    steps = delta("engine_steps_total")
    per_step = (lambda x: x / steps) if steps > 0 else (lambda x: None)
    phases = {p: delta("engine_step_seconds_total", phase=p) * 1e3 for p in
              ("schedule", "prepare_inputs", "forward", "sample")}
    busy = delta("engine_busy_seconds_total")
    step_ms = per_step(busy * 1e3)
    return Figures(
        seconds=dt,
        waiting=max(before.value("num_requests_waiting"), after.value("num_requests_waiting")),
        running=max(before.value("num_requests_running"), after.value("num_requests_running")),
        kv_usage=max(before.value("kv_cache_usage_perc"), after.value("kv_cache_usage_perc")),
        preemptions=delta("num_preemptions_total"),
        requests_finished=delta("request_success_total"),
        prompt_tokens=delta("prompt_tokens_total"),
        generation_tokens=delta("generation_tokens_total"),
        steps=steps,
        batch=per_step(delta("engine_step_requests_total")),
        tokens_per_step=per_step(delta("engine_step_tokens_total")),
        step_ms=step_ms,
        phase_ms={p: v / steps for p, v in phases.items()} if steps > 0 else {},
        # A step's time runs from its scheduling to its outputs, so steps at the window's edges can
        # add up to a little more than the window.
        engine_busy=min(1.0, busy / dt / max(1, len(after.samples.get(PREFIX + "engine_steps_total", [1])))),
        api_cpu=delta("process_cpu_seconds_total") / dt,
        ttft_p50=window_quantile(before, after, "time_to_first_token_seconds"),
        itl_p50=window_quantile(before, after, "inter_token_latency_seconds"),
        queue_p50=window_quantile(before, after, "request_queue_time_seconds"),
        config={**after.info("model_config_info"), **after.info("scheduler_config_info"),
                **after.info("cache_config_info")},
    )


@dataclass
class Finding:
    box: str
    verdict: str
    evidence: list[str]
    flags: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"box": self.box, "verdict": self.verdict, "evidence": self.evidence, "flags": self.flags}


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f} ms"


def diagnose(f: Figures, traces: list[dict[str, Any]]) -> Finding:
    """The box that limits the server in this window (the first symptom that matches)."""
    if f.steps == 0 and f.requests_finished == 0 and f.running == 0 and f.waiting == 0 and f.api_cpu < FRONT_END_CPU:
        return Finding("none", "the server was idle in the window: nothing to diagnose",
                       [f"no engine step and no request finished in {f.seconds:.1f} s"],
                       ["run `kestrel doctor` while the server is under the load you are asking about"])
    for check in (front_end, kv_cache_memory, scheduler_limits, chunked_prefill, model_runner):
        finding = check(f, traces)
        if finding is not None:
            return finding
    return Finding("none", "no box stands out", [summary_line(f)], [])


def summary_line(f: Figures) -> str:
    return (f"{f.generation_tokens / f.seconds:.1f} tokens/s out, {f.prompt_tokens / f.seconds:.1f} in; "
            f"engine busy {f.engine_busy:.0%}; API server CPU {f.api_cpu:.0%} of a core")


def front_end(f: Figures, traces: list[dict[str, Any]]) -> Finding | None:
    if f.api_cpu < FRONT_END_CPU or f.engine_busy >= ENGINE_IDLE_BUSY:
        return None
    evidence = [f"the API server process used {f.api_cpu:.0%} of a core while the engine stepped only "
                f"{f.engine_busy:.0%} of the time ({f.steps / f.seconds:.1f} steps/s, "
                f"{f.running:.0f} requests running)"]
    front = [t["boxes_ms"].get("api_server", 0.0) for t in traces if t.get("boxes_ms")]
    if front:
        evidence.append(f"the last {len(front)} traced requests spent {sorted(front)[len(front) // 2]:.0f} ms "
                        "(median) in the API server (tokenizing, detokenizing, sending)")
    return Finding("api_server", "the front end limits the server: the engine waits for the API server",
                   evidence,
                   ["fewer or smaller requests per second to the front end (large prompts to tokenize, "
                    "/tokenize calls, many streams with logprobs)",
                    "more engine work per request: `stream: false`, fewer `logprobs`",
                    "`--max-queued-requests N` to answer 429 instead of queueing"])


def kv_cache_memory(f: Figures, traces: list[dict[str, Any]]) -> Finding | None:
    if f.waiting <= 0 or (f.kv_usage < KV_FULL and f.preemptions == 0):
        return None
    blocks = f.config.get("num_gpu_blocks", "?")
    evidence = [f"{f.waiting:.0f} requests waiting while {f.kv_usage:.0%} of the {blocks} KV blocks are in use",
                f"{f.preemptions:.0f} preemptions in {f.seconds:.1f} s (a preempted request recomputes its tokens)"]
    flags = ["`--kv-cache-memory SIZE` (CPU) or `--gpu-memory-utilization F` (GPU): a larger KV-cache pool",
             f"`--max-num-seqs N` below {f.config.get('max_num_seqs', 'its value')}: fewer requests share the pool",
             "`--kv-cache-dtype int8`: twice the tokens in the same memory"]
    return Finding("kv_cache_manager", "KV-cache memory limits the server: requests wait for blocks", evidence, flags)


def scheduler_limits(f: Figures, traces: list[dict[str, Any]]) -> Finding | None:
    # Queueing that lasts (a queue time of several steps), not a request caught between two steps.
    if f.waiting <= 0 or f.kv_usage >= KV_ROOMY or f.queue_p50 is None or f.queue_p50 < QUEUED_S:
        return None
    max_seqs, budget = f.config.get("max_num_seqs", "?"), f.config.get("max_num_batched_tokens", "?")
    evidence = [f"{f.waiting:.0f} requests waiting while only {f.kv_usage:.0%} of the KV blocks are in use",
                f"{f.running:.0f} requests running (max_num_seqs {max_seqs}); "
                f"{f.tokens_per_step or 0:.0f} tokens per step (max_num_batched_tokens {budget})",
                f"queue time p50 {ms(f.queue_p50)}, time to first token p50 {ms(f.ttft_p50)}"]
    flags = [f"`--max-num-seqs N` above {max_seqs}: more requests in each step",
             f"`--max-num-batched-tokens N` above {budget}: more tokens in each step"]
    return Finding("scheduler", "the scheduler's limits hold requests back while KV memory is free", evidence, flags)


def chunked_prefill(f: Figures, traces: list[dict[str, Any]]) -> Finding | None:
    budget = float(f.config.get("max_num_batched_tokens", 0) or 0)
    # A preempted request computes its tokens again in more prefill steps: the KV pool's doing, not the budget's.
    chunked = [t for t in traces if t.get("prefill_chunks", 0) > 1 and not t.get("preemptions")
               and t.get("ttft_ms") is not None]
    if traces and len(chunked) * 2 >= len([t for t in traces if t.get("ttft_ms") is not None]) and chunked:
        most = max(t["prefill_chunks"] for t in chunked)
        ttft = sorted(t["ttft_ms"] for t in chunked)[len(chunked) // 2]
        evidence = [f"{len(chunked)} of the last {len(traces)} traced requests needed several prefill chunks "
                    f"(up to {most}) of at most {budget:.0f} tokens before their first token",
                    f"their time to first token: {ttft:.0f} ms (median); queue time p50 {ms(f.queue_p50)}"]
    elif (not traces and budget and f.prompt_tokens > f.generation_tokens and f.tokens_per_step
          and f.tokens_per_step >= 0.8 * budget):
        evidence = [f"steps are full of prompt tokens: {f.tokens_per_step:.0f} per step of a budget of {budget:.0f}, "
                    f"{f.prompt_tokens / f.seconds:.0f} prompt tokens/s against {f.generation_tokens / f.seconds:.0f} "
                    "generated", f"time to first token p50 {ms(f.ttft_p50)} (start the server with "
                    "--request-trace-buffer N for the chunks of each request)"]
    else:
        return None
    return Finding("scheduler", "long prompts wait for the chunked-prefill budget: time to first token is long",
                   evidence, [f"`--max-num-batched-tokens N` above {budget:.0f}: bigger prefill chunks "
                              "(fewer steps before the first token)"])


def model_runner(f: Figures, traces: list[dict[str, Any]]) -> Finding | None:
    if f.engine_busy < BUSY_ENGINE or f.batch is None or f.batch > SMALL_BATCH or not f.step_ms:
        return None
    phase = f.phase_ms
    evidence = [f"the engine stepped {f.engine_busy:.0%} of the time, with {f.batch:.1f} requests per step",
                f"a step takes {f.step_ms:.1f} ms: {phase.get('forward', 0.0):.1f} ms forward, "
                f"{phase.get('prepare_inputs', 0.0):.1f} ms building inputs, {phase.get('sample', 0.0):.1f} ms "
                f"logits and sampling, {phase.get('schedule', 0.0):.1f} ms scheduling",
                f"time per output token p50 {ms(f.itl_p50)}"]
    cfg, flags = f.config, []
    if cfg.get("enforce_eager") == "True":
        flags.append("drop `--enforce-eager`: decode steps through the decode plan")
    if cfg.get("dtype") == "float32":
        flags.append("`--dtype bfloat16`: half the weight bytes per step")
    if cfg.get("quantization", "none") == "none":
        flags.append("`--quantization int8`: int8 weights (check quality with `kestrel bench parity`)")
    flags.append("the CPU kernels: `python -m kestrel.ops` builds them for this CPU (see the server's start-up log)")
    return Finding("model_runner", "the model runner limits the server: small batches, each step's forward pass",
                   evidence, flags)


# ---- the command ----------------------------------------------------------------------------------

def read(client: httpx.Client, url: str) -> Reading:
    r = client.get(f"{url}/metrics")
    r.raise_for_status()
    return Reading.parse(r.text, time.monotonic())


def recent_traces(client: httpx.Client, url: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    r = client.get(f"{url}/v1/requests", params={"limit": 50}, headers=headers)
    if r.status_code != 200:
        return []
    return [t for t in r.json().get("data", []) if t.get("finished")]


def examine(url: str, window_s: float, api_key: str | None = None) -> tuple[Finding, Figures]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=30) as client:
        before = read(client, url)
        time.sleep(window_s)
        after = read(client, url)
        traces = recent_traces(client, url, headers)
    figures = figures_of(before, after)
    return diagnose(figures, traces), figures


def render(finding: Finding, f: Figures, url: str) -> str:
    lines = [f"kestrel doctor: {url}, over {f.seconds:.1f} s", f"  {summary_line(f)}", "",
             f"limiting box: {finding.box}", f"  {finding.verdict}", "", "evidence:"]
    lines += [f"  - {e}" for e in finding.evidence]
    if finding.flags:
        lines += ["", "what to change:"] + [f"  - {flag}" for flag in finding.flags]
    return "\n".join(lines)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the server (default: {DEFAULT_URL})")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_S,
                        help=f"seconds between the two readings of /metrics (default: {DEFAULT_WINDOW_S:g})")
    parser.add_argument("--api-key", default=None, help="the server's API key, for its request traces")
    parser.add_argument("--json", action="store_true", help="print the finding and the figures as JSON")


def main(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    try:
        finding, figures = examine(url, args.window, args.api_key)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot read {url}/metrics: {e}") from None
    if args.json:
        print(json.dumps({"finding": finding.to_dict(), "figures": figures.__dict__}, indent=2))
    else:
        print(render(finding, figures, url))
    return 0
