"""`kestrel bench structured`: what a JSON schema costs a decode step, and how long a schema takes to
compile.

The same requests run constrained to a 50-field JSON schema (strings, integers, numbers, booleans,
enums; every field required, so no output completes the object within 256 tokens and every step of
every request is masked) and unconstrained, greedy with ignore_eos and the same max_tokens, so both
do the same number of steps: one request of W3's shape (128 prompt tokens, 128 output tokens) and
W1's 64 requests at once. One engine; the two settings alternate within each of --runs rounds, and
the prefix cache is emptied before each run. Reported, medians over runs: mean TPOT (a request's
time from its first to its last token over its tokens after the first), output tok/s, and the
constrained/unconstrained ratio; and what a constrained step adds, timed alone (the engine core's
bitmask, the worker's mask), which a noisy machine cannot hide. Compile time: the engine's own
compile (xgrammar, one thread) of the 50-field schema with its cache emptied, median of 5, and the
one-off build of the tokenizer's vocabulary table that the first constrained request waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import UTC, datetime
from typing import Any

from kestrel.bench.common import log, machine_info, set_torch_threads, warn_if_busy
from kestrel.bench.report import load_averages, markdown_table, text_table, write_report
from kestrel.bench.workloads import random_requests, w1_offline_throughput

NUM_FIELDS = 50
DEFAULT_RUNS = 3


def fifty_field_schema(num_fields: int = NUM_FIELDS) -> dict[str, Any]:
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0, "maximum": 10000},
             {"type": "number"}, {"type": "boolean"}, {"type": "string", "enum": ["low", "medium", "high"]}]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_fields)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="rounds; medians are reported (default: 3)")
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's default)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file")


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    if args.runs < 1:
        raise ValueError("--runs must be at least 1")
    if args.num_threads:
        set_torch_threads(args.num_threads)
    from kestrel.entrypoints.llm import LLM
    from kestrel.sampling_params import SamplingParams, StructuredOutputsParams
    started, load_start = datetime.now(UTC), os.getloadavg()
    warn_if_busy(load_start[0])
    llm = LLM(**engine_kwargs)
    schema = json.dumps(fifty_field_schema())
    compile_s, table_s = time_compile(llm, StructuredOutputsParams(json=schema))
    log(f"compile: {compile_s * 1e3:.1f} ms for {NUM_FIELDS} fields; vocabulary table {table_s * 1e3:.0f} ms once")
    step_costs = time_step_costs(llm, StructuredOutputsParams(json=schema))
    log("per step, alone: " + ", ".join(f"{k} {v:.3f} ms" for k, v in step_costs.items()))
    batches = {"batch 1 (W3 shape)": random_requests(1, (128, 128), (128, 128), seed=0),
               "64 requests (W1)": w1_offline_throughput()}
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for name, requests in batches.items():
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        settings = {
            "unconstrained": [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len)
                              for r in requests],
            "json schema": [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len,
                                           structured_outputs=StructuredOutputsParams(json=schema))
                            for r in requests]}
        llm.generate(prompts[:1], settings["json schema"][:1], use_tqdm=False)  # warm-up (compiles the schema)
        results[name] = {s: {"tpot": [], "tok_s": []} for s in settings}
        for run in range(args.runs):
            for setting, params in settings.items():
                tpot, tok_s = time_one_run(llm, prompts, params)
                results[name][setting]["tpot"].append(tpot)
                results[name][setting]["tok_s"].append(tok_s)
                log(f"{name}, {setting}, run {run + 1}/{args.runs}: TPOT {tpot * 1e3:.2f} ms, {tok_s:.1f} output tok/s")
    llm.llm_engine.shutdown()
    report = {"benchmark": "structured", "started": started.isoformat(timespec="seconds"),
              "machine": machine_info(), "load_average_at_start": load_start,
              "load_average_at_end": os.getloadavg(),
              "engine_kwargs": {k: str(v) for k, v in engine_kwargs.items()}, "runs": args.runs,
              "command": getattr(args, "command_line", "kestrel bench structured"),
              "compile_ms": compile_s * 1e3, "vocabulary_table_ms": table_s * 1e3, "num_fields": NUM_FIELDS,
              "step_costs_ms": step_costs,
              "results": results}
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def time_compile(llm: Any, constraint: Any) -> tuple[float, float]:
    """(median compile time of the schema with the caches emptied, time to build the vocabulary table)."""
    manager = llm.llm_engine.engine_core.structured_output
    start = time.perf_counter()
    compiler = manager._get_compiler()
    table_s = time.perf_counter() - start
    times = []
    for _ in range(5):
        compiler.clear_cache()
        start = time.perf_counter()
        manager._compile(constraint)
        times.append(time.perf_counter() - start)
    return statistics.median(times), table_s


def time_step_costs(llm: Any, constraint: Any, repeats: int = 50) -> dict[str, float]:
    """Median ms of what a constrained step adds, alone: the engine core's bitmask for 1 and 64 requests
    (matchers a few fields into the schema) and the worker's mask over 1 and 64 rows of logits."""
    import torch

    from kestrel.core.request import Request
    from kestrel.sample.sampler import apply_token_bitmask
    from kestrel.sampling_params import SamplingParams
    manager = llm.llm_engine.engine_core.structured_output
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode('{"field_0": "abc", "field_1": 12', add_special_tokens=False)
    requests = []
    for i in range(64):
        request = Request(f"bench-{i}", [0], SamplingParams(structured_outputs=constraint), None)
        manager.submit(request)
        request.grammar.compiled.result()
        manager.is_ready(request)
        request.grammar.accept(prefix)
        requests.append((request, []))
    vocab_size = manager.vocab_size

    def median_ms(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    costs = {}
    for n in (1, 64):
        raw, _ = manager.bitmask(requests[:n])
        bitmask = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(n, -1)
        logits = torch.randn(n, vocab_size)
        metadata = argparse.Namespace(token_bitmask=bitmask, token_bitmask_rows=torch.arange(n))
        costs[f"engine-core bitmask, {n} requests"] = median_ms(lambda n=n: manager.bitmask(requests[:n]))
        costs[f"worker mask with the float32 copy, {n} rows"] = median_ms(
            lambda logits=logits, metadata=metadata: apply_token_bitmask(logits.clone(), metadata))
    return costs


def time_one_run(llm: Any, prompts: list[dict], params: list[Any]) -> tuple[float, float]:
    """(mean TPOT, output tok/s) of one run of the requests."""
    llm.llm_engine.engine_core.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (n - 1)
             for o, n in zip(outputs, tokens) if n > 1]
    return statistics.mean(tpots), sum(tokens) / wall


def _rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, by_setting in report["results"].items():
        base = statistics.median(by_setting["unconstrained"]["tpot"])
        for setting, figures in by_setting.items():
            tpot = statistics.median(figures["tpot"])
            rows.append([name, setting, f"{tpot * 1e3:.2f}", f"{statistics.median(figures['tok_s']):.1f}",
                         f"{tpot / base:.3f}"])
    return rows


HEADER = ["batch", "setting", "TPOT ms (median)", "output tok/s (median)", "TPOT vs unconstrained"]


def format_summary(report: dict[str, Any]) -> str:
    return ("\n".join(text_table(HEADER, _rows(report)))
            + "".join(f"\n{k}: {v:.3f} ms" for k, v in report["step_costs_ms"].items())
            + f"\ncompile of a {report['num_fields']}-field schema: {report['compile_ms']:.1f} ms "
              f"(vocabulary table, once per engine: {report['vocabulary_table_ms']:.0f} ms)\n")


def format_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    return (f"\n## Structured outputs: a JSON schema against none ({report['started']})\n\n"
            f"`{report['command']}` on {machine['cpu_model']} ({machine['usable_cpus']} cores), medians of "
            f"{report['runs']} runs; {load_averages(report)}.\n\n"
            + "\n".join(markdown_table(HEADER, _rows(report)))
            + f"\nCompile of the {report['num_fields']}-field schema (xgrammar, one thread, cache emptied): "
              f"{report['compile_ms']:.1f} ms, median of 5; the tokenizer's vocabulary table, built once per "
              f"engine before the first constrained request: {report['vocabulary_table_ms']:.0f} ms. What a "
              "constrained step adds, measured alone (median of 50): "
            + "; ".join(f"{k} {v:.3f} ms" for k, v in report["step_costs_ms"].items()) + ".\n")
