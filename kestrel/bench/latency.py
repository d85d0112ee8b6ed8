"""`kestrel bench latency`: workload W3 (single-stream latency, then 8 concurrent streams).

Every engine runs as a server and is driven through the same OpenAI-compatible client
(kestrel/bench/serve.py), streaming: Kestrel as `kestrel serve` (started here, its own processes),
and each `--peer` (llama.cpp's `llama-server`, see kestrel/bench/launch.py). All servers are started
first, each gets one warm-up request, and then the rounds run interleaved on the same cores: for each
concurrency C (default 1 and 8) and each of `--runs` rounds, every engine in turn is sent the same C
requests at once, each of 128 random prompt tokens and 128 output tokens (greedy, ignore_eos). An idle
server takes no CPU, and interleaving puts every engine's rounds in the same phases of a machine whose
speed drifts. Round r at concurrency C uses seed 1000*C + r, so the rounds differ (no prefix-cache hits
across rounds) and every engine gets the same prompts; llama.cpp is sent `cache_prompt: false`.

Reported per engine and concurrency, as the median over rounds of each round's mean: TTFT, TPOT
(time per output token after the first), and decode tok/s = C / TPOT; plus the engine's peak
resident memory (its whole process tree) and the ratio of Kestrel's TPOT to each peer's (below 1:
Kestrel is faster), with the round-by-round ratios it comes from.

`--neighbour-threads N`: every round runs twice per engine, alone and then beside N busy-spinning
processes (kestrel/bench/neighbours.py) started for that engine's round only, the same for every
engine; each report row gets its "+N busy" twin and the ratio of the two TPOTs (2.0: the engine lost
the cores the neighbours took and nothing more). Each of these rounds is preceded by a settling
request (SETTLE_OUTPUT_LEN tokens) in the same condition, so that the figures are the steady state an
engine reaches beside a neighbour that stays, not its first second of adapting.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import shlex
import statistics
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kestrel.bench.client import Target, resolve_model, send_requests
from kestrel.bench.common import log, machine_info, warn_if_busy
from kestrel.bench.launch import (
    KESTREL_WEIGHTS,
    PEER_SPECS,
    bare_peer,
    check_spec,
    dtype_in_flags,
    is_llama,
    kestrel_weights_flags,
    launch_server,
    named_quantization,
    peer_label,
)
from kestrel.bench.neighbours import BusyNeighbours
from kestrel.bench.peers import RssSampler
from kestrel.bench.report import load_averages, markdown_table, text_table, write_report
from kestrel.bench.workloads import BenchRequest, random_requests, token_id_range

W3_INPUT_LEN = 128
W3_OUTPUT_LEN = 128
W3_CONCURRENCY = (1, 8)
DEFAULT_RUNS = 3
TIMEOUT_S = 600.0
SETTLE_OUTPUT_LEN = 64  # ~2 s of decode on 2 cores: longer than an adaptive pool takes to settle


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=W3_INPUT_LEN, help=f"prompt tokens (default: {W3_INPUT_LEN})")
    parser.add_argument("--output-len", type=int, default=W3_OUTPUT_LEN,
                        help=f"output tokens (default: {W3_OUTPUT_LEN})")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(W3_CONCURRENCY),
                        help="concurrent streams, one setting after another (default: 1 8)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"rounds per concurrency; medians are reported (default: {DEFAULT_RUNS})")
    parser.add_argument("--peer", action="append", type=check_spec, default=[], metavar="SERVER",
                        help=f"also run this server (repeatable): {', '.join(PEER_SPECS)}, or kestrel:FLAGS "
                             "(Kestrel with FLAGS added, e.g. 'kestrel:--async-scheduling')")
    parser.add_argument("--model", help="model for every engine (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--kestrel-flags", default="", help="extra flags for `kestrel serve`, as one string")
    parser.add_argument("--kestrel-weights", choices=KESTREL_WEIGHTS, default="bf16",
                        help="bf16: a GGUF model's weights dequantized to bf16 at load, as the workload is "
                             "defined (--quantization none; a bare llama-server peer on the weights in bf16); "
                             "native: the file's quantized blocks as Kestrel serves them by default (a bare "
                             "llama-server peer on the same file) (default: bf16)")
    parser.add_argument("--neighbour-threads", type=int, default=0, metavar="N",
                        help="also run every round beside N busy-spinning processes, and report the TPOT with "
                             "them over the TPOT alone (default: 0, no neighbours)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file")


def main(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.input_len < 1 or args.output_len < 2 or min(args.concurrency) < 1:
        raise ValueError("--runs, --input-len and --concurrency must be >= 1 and --output-len >= 2")
    if args.neighbour_threads < 0:
        raise ValueError("--neighbour-threads must be >= 0")
    started = datetime.now(UTC)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    engines = measure_engines(["kestrel", *args.peer], args)
    report = {
        "benchmark": "latency", "workload": {
            "id": "W3" if (args.input_len, args.output_len) == (W3_INPUT_LEN, W3_OUTPUT_LEN) else "W3 (modified)",
            "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
            "runs": args.runs, "sampling": "greedy, ignore_eos, streamed",
            "neighbour_threads": neighbour_threads(args), "kestrel_weights": args.kestrel_weights,
            "kestrel_flags": kestrel_weights_flags(args.kestrel_weights, shlex.split(args.kestrel_flags))},
        "command": getattr(args, "command_line", "kestrel bench latency"),
        "date": started.isoformat(timespec="seconds"),
        "load_average_at_start": list(load_average), "load_average_at_end": list(os.getloadavg()),
        "machine": machine_info(), "engines": engines,
    }
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


@dataclass
class LiveEngine:
    """A started server, what it is sent, and the rounds it has run."""
    spec: str
    server: Any
    target: Target
    model: str
    rss: RssSampler
    rounds: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    neighbour_rounds: dict[int, list[dict[str, float]]] = field(default_factory=dict)  # beside busy neighbours


@functools.cache
def prompt_id_range(model: str | None) -> tuple[int, int]:
    """The prompts' token ids, inside the model's vocabulary."""
    from kestrel.model.loader import load_config, resolve_model
    return token_id_range(int(load_config(resolve_model(model)).vocab_size))


def neighbour_threads(args: argparse.Namespace) -> int:
    return getattr(args, "neighbour_threads", 0)


def measure_engines(specs: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start every engine's server, then run the rounds interleaved: for each concurrency and round,
    every engine in turn on the same prompts. The machine's speed drifts by tens of per cent within
    minutes; interleaving puts each engine's rounds in the same phases, so their ratio holds still."""
    with ExitStack() as stack:
        engines = [start_engine(stack, spec, args) for spec in specs]
        for c, r in rounds_to_run(args.concurrency, args.runs):
            requests = random_requests(c, (args.input_len, args.input_len), (args.output_len, args.output_len),
                                       seed=1000 * c + r, id_range=prompt_id_range(args.model))
            for e in engines:
                if neighbour_threads(args):
                    settle(e, args)
                e.rounds.setdefault(c, []).append(run_round(e, requests, args.output_len))
                log_round(e, c, r, args, e.rounds[c][-1], "")
                if neighbour_threads(args):
                    with BusyNeighbours(neighbour_threads(args)):
                        settle(e, args)
                        e.neighbour_rounds.setdefault(c, []).append(run_round(e, requests, args.output_len))
                    log_round(e, c, r, args, e.neighbour_rounds[c][-1], f" beside {neighbour_threads(args)} busy")
        return [summarize(e, args.concurrency) for e in engines]


def log_round(e: LiveEngine, c: int, r: int, args: argparse.Namespace, result: dict[str, float], beside: str) -> None:
    log(f"{e.spec}, {c} concurrent{beside}, round {r + 1}/{args.runs}: TTFT {result['ttft_s'] * 1e3:.1f} ms, "
        f"TPOT {result['tpot_s'] * 1e3:.2f} ms")


def settle(engine: LiveEngine, args: argparse.Namespace) -> None:
    """One request of SETTLE_OUTPUT_LEN tokens, unmeasured: the engine decodes in the round's
    condition (alone, or beside the neighbours) before the round starts."""
    request = random_requests(1, (args.input_len, args.input_len), (SETTLE_OUTPUT_LEN, SETTLE_OUTPUT_LEN), seed=2,
                              id_range=prompt_id_range(args.model))
    asyncio.run(send_requests(engine.target, engine.model, request, [0.0]))


def rounds_to_run(concurrency: list[int], runs: int) -> list[tuple[int, int]]:
    """(concurrency, round) in the order they run; every engine runs each before the next starts."""
    return [(c, r) for c in concurrency for r in range(runs)]


def start_engine(stack: ExitStack, spec: str, args: argparse.Namespace) -> LiveEngine:
    kestrel_flags = kestrel_weights_flags(args.kestrel_weights, shlex.split(args.kestrel_flags))
    if is_llama(spec):  # a bare llama-server runs Kestrel's weights: its --dtype's precision, or the file
        spec = bare_peer(spec, dtype_in_flags(kestrel_flags), args.kestrel_weights)
    server = launch_server(spec, parallel=max(args.concurrency), ctx_per_slot=args.input_len + args.output_len + 16,
                           kestrel_flags=kestrel_flags, model=args.model)
    log(f"{spec}: starting")
    stack.enter_context(server)
    rss = stack.enter_context(RssSampler(server.pid))
    target = Target(server.base_url, timeout=TIMEOUT_S,
                    extra_body={"cache_prompt": False} if is_llama(spec) else {})
    model, _ = asyncio.run(resolve_model(target))
    warm = random_requests(1, (args.input_len, args.input_len), (16, 16), seed=1, id_range=prompt_id_range(args.model))
    asyncio.run(send_requests(target, model, warm, [0.0]))
    return LiveEngine(spec, server, target, model, rss)


def run_round(engine: LiveEngine, requests: list[BenchRequest], output_len: int) -> dict[str, float]:
    """Send the round's requests at once; the mean TTFT and TPOT over them (seconds)."""
    results, _ = asyncio.run(send_requests(engine.target, engine.model, requests, [0.0] * len(requests)))
    failed = [x.error for x in results if not x.ok]
    if failed:
        raise RuntimeError(f"{engine.spec}: {len(failed)} request(s) failed: {failed[0]}")
    short = [x.output_tokens for x in results if x.output_tokens != output_len]
    if short:
        raise RuntimeError(f"{engine.spec}: produced {short[0]} tokens, expected {output_len}")
    return {"ttft_s": statistics.mean(x.ttft_s for x in results),
            "tpot_s": statistics.mean(x.tpot_s for x in results)}


def summarize(engine: LiveEngine, concurrency: list[int]) -> dict[str, Any]:
    settings = []
    for c in concurrency:
        setting = {"concurrency": c, **medians(engine.rounds[c], c)}
        if c in engine.neighbour_rounds:
            beside = medians(engine.neighbour_rounds[c], c)
            setting["neighbour"] = beside
            setting["neighbour_tpot_ratio"] = beside["tpot_ms"] / setting["tpot_ms"]
        settings.append(setting)
    spec = engine.spec
    label = peer_label(spec)
    return {"spec": spec, "label": label, "server": engine.server.label, "peak_rss_bytes": engine.rss.peak,
            "settings": settings}


def medians(rounds: list[dict[str, float]], concurrency: int) -> dict[str, Any]:
    ttft = statistics.median(x["ttft_s"] for x in rounds)
    tpot = statistics.median(x["tpot_s"] for x in rounds)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "decode_tok_s": concurrency / tpot, "rounds": rounds}


def paired_tpot_ratios(kestrel: dict[str, Any], peer: dict[str, Any]) -> list[list[float]]:
    """Per concurrency, Kestrel's TPOT over the peer's round by round (the rounds ran side by side)."""
    return [[k["tpot_s"] / p["tpot_s"] for k, p in zip(ks["rounds"], ps["rounds"])]
            for ks, ps in zip(kestrel["settings"], peer["settings"])]


def _rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    engines = report["engines"]
    busy = report["workload"].get("neighbour_threads", 0)
    for e in engines:
        for s in e["settings"]:
            rows.append((e["label"], str(s["concurrency"]), f"{s['ttft_ms']:.1f}", f"{s['tpot_ms']:.2f}",
                         f"{s['decode_tok_s']:.1f}", f"{e['peak_rss_bytes'] / (1 << 30):.2f} GiB"))
            if "neighbour" in s:
                n = s["neighbour"]
                rows.append((f"{e['label']} +{busy} busy", str(s["concurrency"]), f"{n['ttft_ms']:.1f}",
                             f"{n['tpot_ms']:.2f}", f"{n['decode_tok_s']:.1f}", ""))
    kestrel = engines[0]
    for peer in engines[1:]:
        for ks, ps in zip(kestrel["settings"], peer["settings"]):
            rows.append((f"kestrel / {peer['label']}", str(ks["concurrency"]), f"{ks['ttft_ms'] / ps['ttft_ms']:.2f}",
                         f"{ks['tpot_ms'] / ps['tpot_ms']:.2f}", f"{ks['decode_tok_s'] / ps['decode_tok_s']:.2f}",
                         f"{kestrel['peak_rss_bytes'] / peer['peak_rss_bytes']:.2f}"))
    return rows


HEADER = ("engine", "concurrent", "TTFT ms", "TPOT ms", "decode tok/s", "peak RSS")


def paired_lines(report: dict[str, Any]) -> list[str]:
    engines = report["engines"]
    lines = []
    for peer in engines[1:]:
        for s, ratios in zip(engines[0]["settings"], paired_tpot_ratios(engines[0], peer)):
            lines.append(f"Kestrel's TPOT over {peer['label']}'s at {s['concurrency']} concurrent, round by round: "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}).")
    return lines


def neighbour_lines(report: dict[str, Any]) -> list[str]:
    """Per engine and concurrency: TPOT beside the busy neighbours over TPOT alone."""
    busy = report["workload"].get("neighbour_threads", 0)
    lines = []
    for e in report["engines"]:
        for s in e["settings"]:
            if "neighbour" in s:
                rounds = [n["tpot_s"] / a["tpot_s"] for a, n in zip(s["rounds"], s["neighbour"]["rounds"])]
                lines.append(f"{e['label']}'s TPOT beside {busy} busy neighbour thread(s) over alone at "
                             f"{s['concurrency']} concurrent: {s['neighbour_tpot_ratio']:.2f}x (medians; round by "
                             f"round {', '.join(f'{x:.2f}' for x in rounds)}).")
    return lines


def format_summary(report: dict[str, Any]) -> str:
    lines = text_table(HEADER, _rows(report))
    lines.extend(paired_lines(report))
    lines.extend(neighbour_lines(report))
    w = report["workload"]
    lines.append(f"workload {w['id']}: {w['input_len']} prompt + {w['output_len']} output tokens per request; "
                 f"medians of {w['runs']} round(s)")
    return "\n".join(lines)


WEIGHTS_NAMES = {"bf16": "bf16, a GGUF file's blocks dequantized at load (--quantization none)",
                 "native": "the GGUF file's blocks, as it stores them (a bare llama-server reads the same file)"}


def weights_description(workload: dict[str, Any]) -> str:
    """What Kestrel ran on: the --kestrel-weights choice, unless --kestrel-flags named a quantization."""
    quantization = named_quantization(workload.get("kestrel_flags", []))
    if quantization not in (None, "none"):
        return f"--quantization {quantization} (from --kestrel-flags)"
    return WEIGHTS_NAMES[workload.get("kestrel_weights", "bf16")]


def format_markdown(report: dict[str, Any]) -> str:
    w, m = report["workload"], report["machine"]
    table = markdown_table(HEADER, _rows(report))
    lines = [
        "", f"## {w['id']} latency — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'}; "
        f"{load_averages(report)}",
        f"- Workload: {w['input_len']} random prompt tokens, {w['output_len']} output tokens, {w['sampling']}; "
        f"concurrency {', '.join(map(str, w['concurrency']))}; every engine is a server driven by the same "
        f"client; medians of {w['runs']} rounds of per-round means",
        f"- Kestrel's weights: {weights_description(w)}",
        "", *table, "",
        "Ratio rows: Kestrel's figure over the peer's (TTFT and TPOT: below 1 is faster; decode tok/s: above 1).",
        "The engines' rounds ran interleaved (each round: every engine in turn, same prompts).",
        *paired_lines(report),
        *neighbour_lines(report),
    ]
    return "\n".join(lines) + "\n"
