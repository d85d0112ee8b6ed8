"""The throughput benchmark's report: the JSON record (with the roofline figures), the text summary
and the Markdown section. See kestrel/bench/throughput.py."""

from __future__ import annotations

import argparse
import os
import statistics
from datetime import datetime
from typing import Any

from kestrel.bench.common import EngineResult, machine_info
from kestrel.bench.report import load_averages, markdown_table, text_table
from kestrel.bench.workloads import (
    W1_SEED,
    W4_NUM_REQUESTS,
    W4_PREFIX_LEN,
    W4_UNIQUE_LEN,
    W6_TOKEN_ID_RANGE,
    BenchRequest,
    is_standard_w1,
)


def build_report(args: argparse.Namespace, requests: list[BenchRequest], results: list[EngineResult],
                 engine_info: dict[str, Any], started: datetime, load_average: tuple[float, float, float],
                 limits: dict[str, Any] | None = None) -> dict[str, Any]:
    if args.workload == "W4":
        workload_id = "W4" if len(requests) == W4_NUM_REQUESTS else "W4 (reduced)"
        shape = {"prefix_len": W4_PREFIX_LEN, "unique_len": W4_UNIQUE_LEN}
    else:
        standard = is_standard_w1(len(requests), tuple(args.input_len_range), tuple(args.output_len_range))
        workload_id = args.workload if standard else f"{args.workload} (reduced)"
        shape = {"input_len_range": list(args.input_len_range), "output_len_range": list(args.output_len_range)}
        if args.workload == "W6":
            shape["token_id_range"] = list(W6_TOKEN_ID_RANGE)
    kestrel = results[0]
    roofline = None
    if limits is not None:
        from kestrel.bench.roofline import ParamCounts, decode_bytes, workload_flops
        params = ParamCounts(limits["non_embedding_params"], limits["output_head_params"])
        flops = workload_flops(kestrel.input_tokens, kestrel.output_tokens, params)
        moved = decode_bytes([r.input_len for r in requests], [r.output_len for r in requests],
                             limits["weight_bytes"], limits["kv_bytes_per_token"])
        achieved = flops / kestrel.wall_s / 1e9
        # The machine's AMX rate drifts by 2-3x over a day: each run is also set against the rate
        # measured just before it, and the median of those paired fractions reported.
        paired = [flops / wall / 1e9 / rate for wall, rate in zip(kestrel.run_wall_s, kestrel.run_roofline_gflops)]
        rate = limits["fp32_gflops" if limits["roofline_dtype"] == "float32" else "bf16_gflops"]
        compute_floor, memory_floor = flops / (rate * 1e9), moved / (limits["read_gb_s"] * 1e9)
        # The roofline proper: compute and memory overlapped at best, so the longer of the two floors.
        roofline_wall = max(compute_floor, memory_floor)
        roofline = {**limits, "workload_flops": flops, "kestrel_gflops": achieved, "roofline_gflops": rate,
                    "fraction_of_roofline": achieved / rate, "fraction_of_bf16": achieved / limits["bf16_gflops"],
                    "limit_wall_s": compute_floor,
                    "decode_bytes": moved, "memory_floor_s": memory_floor, "roofline_wall_s": roofline_wall,
                    "fraction_of_full_roofline": roofline_wall / kestrel.wall_s,
                    # The most of the compute roofline any engine could reach here: where the memory
                    # floor is the longer, below 1 (and a compute-only target above it is out of reach).
                    "max_fraction_of_roofline": compute_floor / roofline_wall,
                    "per_run_roofline_gflops": kestrel.run_roofline_gflops, "per_run_fraction": paired,
                    "median_paired_fraction": statistics.median(paired) if paired else None}
    return {
        "benchmark": "throughput",
        "workload": {
            "id": workload_id, "num_requests": len(requests), **shape,
            "seed": W1_SEED, "input_tokens": kestrel.input_tokens, "output_tokens": kestrel.output_tokens,
            "sampling": "greedy, ignore_eos, max_tokens = output length", "runs": args.runs,
        },
        "command": getattr(args, "command_line", "kestrel bench throughput"),
        "date": started.isoformat(timespec="seconds"),
        "load_average_at_start": list(load_average),
        "load_average_at_end": list(os.getloadavg()),
        "machine": machine_info(),
        "engine": engine_info,
        "results": [r.to_dict() for r in results],
        "ratios_output_tok_s": {r.name: kestrel.output_tok_s / r.output_tok_s for r in results[1:]},
        "roofline": roofline,
    }


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / (1 << 30):.2f} GiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def _rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    results = report["results"]
    rows = [(r["name"], f"{r['wall_s']:.2f}", f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
             _ms(r["mean_ttft_s"]), _gib(r["peak_rss_bytes"])) for r in results]
    k = results[0]
    for p in results[1:]:
        ttft = (f"{k['mean_ttft_s'] / p['mean_ttft_s']:.2f}" if k["mean_ttft_s"] and p["mean_ttft_s"] else "-")
        mem = f"{k['peak_rss_bytes'] / p['peak_rss_bytes']:.2f}" if p["peak_rss_bytes"] else "-"
        rows.append((f"{k['name']} / {p['name']}", f"{k['wall_s'] / p['wall_s']:.2f}",
                     f"{k['output_tok_s'] / p['output_tok_s']:.2f}", f"{k['total_tok_s'] / p['total_tok_s']:.2f}",
                     ttft, mem))
    return rows


HEADER = ("engine", "wall s", "output tok/s", "total tok/s", "mean TTFT ms", "peak RSS")


def _roofline_line(report: dict[str, Any]) -> str | None:
    r = report["roofline"]
    if not r:
        return None
    return (f"Machine limits measured in this run ({r['threads']} threads): bf16 matmul {r['bf16_gflops']:.0f} "
            f"GFLOP/s, fp32 {r['fp32_gflops']:.0f} GFLOP/s (FLOP-weighted over the layer shapes "
            f"{', '.join(f'{o}x{i}' for o, i in r['shapes'])} at 1024 rows), copy {r['copy_gb_s']:.1f} GB/s. "
            f"Workload FLOPs {r['workload_flops'] / 1e12:.2f} T (non-embedding params "
            f"{r['non_embedding_params'] / 1e6:.1f} M, output head {r['output_head_params'] / 1e6:.1f} M): "
            f"{report['results'][0]['name']} reaches {r['kestrel_gflops']:.0f} GFLOP/s = "
            f"**{100 * r['fraction_of_roofline']:.0f}% of the {_short(r['roofline_dtype'])} roofline** "
            f"(the limit would run it in "
            f"{r['limit_wall_s']:.1f} s)" + _paired_roofline(r) + _memory_roofline(r))


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def _paired_roofline(r: dict[str, Any]) -> str:
    if not r.get("per_run_fraction"):
        return ""
    runs = ", ".join(f"{100 * f:.0f}% of {g:.0f}" for f, g in zip(r["per_run_fraction"], r["per_run_roofline_gflops"]))
    return (f". Each run against the {_short(r['roofline_dtype'])} rate measured just before it: {runs} GFLOP/s; "
            f"median **{100 * r['median_paired_fraction']:.0f}%**")


def _memory_roofline(r: dict[str, Any]) -> str:
    """The memory side (reports before 2026-12-01 have none)."""
    if "memory_floor_s" not in r:
        return ""
    return (f". Memory: the decode steps must read at least {r['decode_bytes'] / 1e9:.1f} GB (every weight "
            f"once a step, every cached K/V row once an output token), {r['memory_floor_s']:.1f} s at the "
            f"{r['read_gb_s']:.1f} GB/s streaming read rate measured in this run; against the roofline with "
            f"that memory roof (the longer of the two floors, {r['roofline_wall_s']:.1f} s) Kestrel is at "
            f"**{100 * r['fraction_of_full_roofline']:.0f}%**" + _memory_cap(r))


def _memory_cap(r: dict[str, Any]) -> str:
    """Where the memory floor is the longer: the most of the compute roofline any engine could reach."""
    cap = r.get("max_fraction_of_roofline")
    if cap is None or cap >= 1:
        return ""
    return (f"; the memory floor caps any engine that decodes one token a step at "
            f"{100 * cap:.0f}% of the {_short(r['roofline_dtype'])} roofline on this machine")


def _model_file(engine: dict[str, Any]) -> str:
    """The file (GGUF) or folder Kestrel read."""
    gguf = engine.get("gguf_file")
    return os.path.join(engine["model_path"], gguf) if gguf else engine["model_path"]


def _precision(engine: dict[str, Any]) -> str:
    """The model dtype, with --quantization and --kv-cache-dtype where they are on (earlier reports
    have no such keys)."""
    text = engine["dtype"]
    if engine.get("quantization"):
        text += f" with --quantization {engine['quantization']}"
    if engine.get("kv_cache_dtype", "auto") != "auto":
        text += f" and an {engine['kv_cache_dtype']} KV cache"
    return text


def format_summary(report: dict[str, Any]) -> str:
    lines = text_table(HEADER, _rows(report))
    w, e, m = report["workload"], report["engine"], report["machine"]
    lines += [
        f"workload {w['id']}: {w['num_requests']} requests, {w['input_tokens']} prompt + {w['output_tokens']} "
        f"output tokens; median of {w['runs']} run(s)",
        f"model {e['model']} ({e['format']}, read {_model_file(e)}), "
        f"{_precision(e)} on {e['device']}; "
        f"{m['cpu_model']}, {m['usable_cpus']} cpus, bf16 flags: {' '.join(m['bf16_flags']) or 'none'}",
    ]
    if (line := _roofline_line(report)) is not None:
        lines.append(line.replace("**", ""))
    for side in report["results"]:
        for note in side.get("notes", []):
            lines.append(f"note ({side['name']}): {note}")
    return "\n".join(lines)


def _workload_line(w: dict[str, Any]) -> str:
    if w["id"].startswith("W4"):
        return (f"{w['num_requests']} requests sharing a {w['prefix_len']}-token prefix, each with "
                f"{w['unique_len']} tokens of its own ({w['input_tokens']} prompt tokens), "
                f"{w['output_tokens']} output tokens in all, {w['sampling']}; median of {w['runs']} run(s)")
    ids = f", prompt ids {w['token_id_range'][0]}..{w['token_id_range'][1]}" if "token_id_range" in w else ""
    return (f"{w['num_requests']} requests, input {w['input_len_range'][0]}..{w['input_len_range'][1]} "
            f"({w['input_tokens']} tokens), output {w['output_len_range'][0]}..{w['output_len_range'][1]} "
            f"({w['output_tokens']} tokens), seed {w['seed']}{ids}, {w['sampling']}; median of {w['runs']} run(s)")


def format_markdown(report: dict[str, Any]) -> str:
    w, e, m = report["workload"], report["engine"], report["machine"]
    table = markdown_table(HEADER, _rows(report))
    runs = "; ".join(f"{side['name']}: {', '.join(f'{t:.2f}' for t in side['run_wall_s'])} s"
                     for side in report["results"])
    title = "shared prefix" if w["id"].startswith("W4") else "offline throughput"
    if w["id"].startswith("W6"):
        title += " of a 1B-class model"
    lines = [
        "", f"## {w['id']} {title} — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'} (torch capability {m['torch_cpu_capability']}); "
        f"torch {m['torch']}, transformers {m['transformers']}; "
        f"{load_averages(report)}; threads: "
        + ", ".join(f"{side['name']} {side['torch_threads']}" for side in report["results"]),
        f"- Model: {e['model']}, {e['format']}, {_precision(e)} on {e['device']}; Kestrel read {_model_file(e)}",
        f"- Workload: {_workload_line(w)}",
        f"- Kestrel: max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens {e['max_num_batched_tokens']}, "
        f"{e['num_kv_blocks']} KV blocks of {e['block_size']}, prefix caching emptied before each run, "
        f"chunked prefill {'on' if e['enable_chunked_prefill'] else 'off'}; in-process `LLM.generate`. "
        "llama-server peers: every request at once through the benchmark's HTTP client "
        "(W1, W6: non-streaming, cache_prompt false; W4: streaming, cache_prompt true)",
        "", *table, "",
        f"Run wall times: {runs}. Only generation is timed (after a short warm-up), not model load.",
    ]
    if (line := _roofline_line(report)) is not None:
        lines += ["", line + "."]
    for side in report["results"]:
        for note in side.get("notes", []):
            lines.append(f"Note ({side['name']}): {note}.")
    return "\n".join(lines) + "\n"
