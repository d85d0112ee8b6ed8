"""`kestrel bench speculative`: workload W5 (copy-heavy), n-gram speculative decoding against none.

W5: 32 chat requests, each an order list of about 300 tokens (seed 0) and "repeat it with one line
changed"; greedy, up to 200 output tokens, stopping at EOS. Every request is submitted at once through
`LLM.generate` (prompt token ids from the model's chat template). Kestrel runs it without speculation
and with `{"method": "ngram", "num_speculative_tokens": K}` for each --k, one engine per setting,
each warmed up, then --runs rounds in which every engine in turn runs the whole workload (so that a
machine whose speed drifts treats them alike); the prefix cache is emptied before each run.

Reported per setting, medians over runs: wall time, output tok/s, mean TPOT (a request's time from
its first to its last token over its tokens after the first), and the speed-up over no speculation;
for speculation, the acceptance rate, mean acceptance length (tokens per verified draft, the sampled
one included) and the acceptance rate at each draft position, from the engine's own counters; and how
many outputs equal those without speculation (the fewest over runs). In float32 they all do (the
tests check it); in bf16 a verification step computes its rows in a batch of k + 1 where a plain
decode step computes one, so rounding differs and an output can leave the other at a near-tie.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kestrel.bench.common import log, machine_info, set_torch_threads, warn_if_busy
from kestrel.bench.report import load_averages, markdown_table, text_table, write_report
from kestrel.bench.workloads import W5_NUM_REQUESTS, W5_OUTPUT_LEN, w5_copy_messages

DEFAULT_K = (2, 4, 8)
DEFAULT_RUNS = 3


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, nargs="+", default=list(DEFAULT_K),
                        help="num_speculative_tokens settings to compare with none (default: 2 4 8)")
    parser.add_argument("--disable-by-batch-size", type=int, metavar="N",
                        help="speculative_config's disable_by_batch_size for every K: no drafts while N or more "
                             "requests run")
    parser.add_argument("--num-prompts", type=int, default=W5_NUM_REQUESTS,
                        help=f"requests (default: {W5_NUM_REQUESTS})")
    parser.add_argument("--output-len", type=int, default=W5_OUTPUT_LEN,
                        help=f"max_tokens per request (default: {W5_OUTPUT_LEN})")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="rounds; medians are reported (default: 3)")
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's default)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file")


@dataclass
class Setting:
    name: str
    speculative_config: dict | None
    walls: list[float] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    num_same: list[int] = field(default_factory=list)   # requests whose tokens equal no speculation's
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    if args.runs < 1 or args.num_prompts < 1 or any(k < 1 for k in args.k):
        raise ValueError("--runs, --num-prompts and every --k must be at least 1")
    if args.num_threads:
        set_torch_threads(args.num_threads)
    from kestrel.entrypoints.llm import LLM
    from kestrel.sampling_params import SamplingParams
    started, load_start = datetime.now(UTC), os.getloadavg()
    warn_if_busy(load_start[0])
    policy = {} if args.disable_by_batch_size is None else {"disable_by_batch_size": args.disable_by_batch_size}
    settings = [Setting("no speculation", None)] + [
        Setting(f"ngram K={k}", {"method": "ngram", "num_speculative_tokens": k, **policy}) for k in args.k]
    engines = []
    for s in settings:
        log(f"{s.name}: loading")
        engines.append(LLM(**engine_kwargs, speculative_config=s.speculative_config))
    tokenizer = engines[0].get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False)}
               for m in w5_copy_messages(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    log(f"workload W5: {len(prompts)} requests, {sum(len(p['prompt_token_ids']) for p in prompts)} prompt tokens")
    for llm in engines:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    reference: list[list[int]] | None = None
    for run in range(args.runs):
        for s, llm in zip(settings, engines):
            tokens = time_one_run(s, llm, prompts, params)
            if reference is None:
                reference = tokens
            s.num_same.append(sum(a == b for a, b in zip(tokens, reference)))
            log(f"{s.name} run {run + 1}/{args.runs}: {s.walls[-1]:.2f} s, "
                f"{s.output_tokens[-1] / s.walls[-1]:.1f} output tok/s, TPOT {s.tpots[-1] * 1e3:.1f} ms, "
                f"{s.num_same[-1]}/{len(prompts)} outputs as without speculation")
    for s, llm in zip(settings, engines):
        stats = llm.llm_engine.spec_decoding_stats
        s.drafts, s.draft_tokens, s.accepted = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
        s.accepted_per_pos = list(stats.num_accepted_tokens_per_pos)
        llm.llm_engine.shutdown()
    del engines
    gc.collect()
    report = build_report(args, settings, engine_kwargs, started, load_start)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def time_one_run(s: Setting, llm: Any, prompts: list[dict], params: Any) -> list[list[int]]:
    llm.llm_engine.engine_core.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    s.walls.append(time.perf_counter() - start)
    tokens = [o.outputs[0].token_ids for o in outputs]
    s.output_tokens.append(sum(len(t) for t in tokens))
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(t) - 1)
             for o, t in zip(outputs, tokens) if len(t) > 1]
    s.tpots.append(statistics.mean(tpots) if tpots else 0.0)
    return tokens


def build_report(args: argparse.Namespace, settings: list[Setting], engine_kwargs: dict[str, Any],
                 started: datetime, load_start: tuple[float, float, float]) -> dict[str, Any]:
    base_wall = statistics.median(settings[0].walls)
    rows = []
    for s in settings:
        wall = statistics.median(s.walls)
        row = {"name": s.name, "speculative_config": s.speculative_config, "run_wall_s": s.walls,
               "median_wall_s": wall, "output_tokens": s.output_tokens,
               "median_output_tok_s": statistics.median(n / w for n, w in zip(s.output_tokens, s.walls)),
               "median_tpot_s": statistics.median(s.tpots), "speedup": base_wall / wall,
               "min_outputs_as_no_speculation": min(s.num_same)}
        if s.drafts:
            row.update(num_drafts=s.drafts, num_draft_tokens=s.draft_tokens, num_accepted_tokens=s.accepted,
                       acceptance_rate=s.accepted / s.draft_tokens, mean_acceptance_length=1 + s.accepted / s.drafts,
                       acceptance_per_position=[n / s.drafts for n in s.accepted_per_pos])
        rows.append(row)
    return {"benchmark": "speculative", "workload": "W5", "started": started.isoformat(timespec="seconds"),
            "command": "kestrel bench speculative " + " ".join(_command_args(args, engine_kwargs)),
            "machine": machine_info(), "load_average_at_start": list(load_start),
            "load_average_at_end": list(os.getloadavg()), "num_requests": args.num_prompts,
            "max_tokens": args.output_len, "runs": args.runs, "settings": rows}


def _command_args(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> list[str]:
    out = ["--k", *map(str, args.k), "--runs", str(args.runs)]
    if args.num_prompts != W5_NUM_REQUESTS:
        out += ["--num-prompts", str(args.num_prompts)]
    if args.output_len != W5_OUTPUT_LEN:
        out += ["--output-len", str(args.output_len)]
    if getattr(args, "disable_by_batch_size", None) is not None:
        out += ["--disable-by-batch-size", str(args.disable_by_batch_size)]
    out += [f"--{k.replace('_', '-')} {v}" for k, v in engine_kwargs.items()]
    return out


def _rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for s in report["settings"]:
        accept = (f"{100 * s['acceptance_rate']:.0f}%, {s['mean_acceptance_length']:.2f}, "
                  + " / ".join(f"{x:.2f}" for x in s["acceptance_per_position"])) if "num_drafts" in s else "-"
        rows.append([s["name"], f"{s['median_wall_s']:.2f}", f"{s['median_output_tok_s']:.1f}",
                     f"{s['median_tpot_s'] * 1e3:.1f}", f"{s['speedup']:.2f}x", accept,
                     f"{s['min_outputs_as_no_speculation']}/{report['num_requests']}"])
    return rows


HEADER = ["setting", "wall s", "output tok/s", "TPOT ms", "speed-up", "accepted, mean length, per position",
          "outputs as without"]


def format_summary(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"W5 (copy-heavy), {report['num_requests']} requests, max_tokens {report['max_tokens']}, "
             f"medians of {report['runs']} runs; {m['cpu_model']}, {m['usable_cpus']} cores",
             *text_table(HEADER, _rows(report))]
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"\n## W5 speculative decoding, {report['started']}", "",
             f"`{report['command']}` on {m['cpu_model']} ({m['usable_cpus']} cores, torch capability "
             f"{m['torch_cpu_capability']}), {load_averages(report)}. Medians of {report['runs']} runs, the "
             "settings interleaved.", "", *markdown_table(HEADER, _rows(report)), ""]
    return "\n".join(lines)
