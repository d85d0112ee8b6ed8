"""`kestrel bench throughput`: workload W1 (offline throughput), optionally against a peer.

Kestrel: every request is submitted at once through `LLM.generate` (prompt token ids, greedy,
ignore_eos, max_tokens = the request's output length). Only `generate` is timed, after one short
warm-up; the prefix cache is emptied before each run so that a repeated run cannot hit the
previous run's blocks. The figure reported is the median of --runs runs.

Peer `transformers`: `model.generate` on the same weights in the same dtype, run in a child process
so that its memory is its own. Requests go in batches of --peer-batch-size, in request order,
left-padded; each batch generates up to its longest output (min_new_tokens = max_new_tokens), and
only each request's own output length counts as useful output.

Peak resident memory: the larger of the RSS sampled while the model loads and VmHWM at the end
(the engine resets VmHWM when it profiles memory, so VmHWM alone would miss the load peak).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from kestrel.bench.workloads import (W1_INPUT_LEN_RANGE, W1_NUM_REQUESTS, W1_OUTPUT_LEN_RANGE, W1_SEED,
                                     BenchRequest, is_standard_w1, random_requests, w1_offline_throughput)

PEERS = ("transformers",)
DEFAULT_RUNS = 3
DEFAULT_PEER_BATCH_SIZE = 16
RSS_SAMPLE_INTERVAL_S = 0.01

T = TypeVar("T")


# ---- command line -------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=W1_NUM_REQUESTS,
                        help=f"number of requests (default: {W1_NUM_REQUESTS})")
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_INPUT_LEN_RANGE), help="prompt lengths, uniform, inclusive "
                        f"(default: {W1_INPUT_LEN_RANGE[0]} {W1_INPUT_LEN_RANGE[1]})")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_OUTPUT_LEN_RANGE), help="output lengths, uniform, inclusive "
                        f"(default: {W1_OUTPUT_LEN_RANGE[0]} {W1_OUTPUT_LEN_RANGE[1]})")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"timed runs per engine; the median is reported (default: {DEFAULT_RUNS})")
    parser.add_argument("--peer", choices=PEERS, help="also run this peer on the same weights and dtype")
    parser.add_argument("--peer-batch-size", type=int, default=DEFAULT_PEER_BATCH_SIZE,
                        help=f"requests per transformers generate call (default: {DEFAULT_PEER_BATCH_SIZE})")
    parser.add_argument("--num-threads", type=int, help="torch threads for Kestrel and the peer alike "
                        "(default: torch's default, one per core)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file "
                                                            "(e.g. BENCHMARKS.md)")


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run the benchmark the parsed command line describes; print the report; 0 on success."""
    check_options(args)
    requests = w1_offline_throughput(args.num_prompts, tuple(args.input_len_range),
                                     tuple(args.output_len_range))
    log(f"workload: {len(requests)} requests, {sum(r.input_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens")
    started = datetime.now(timezone.utc)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    if args.num_threads:
        set_torch_threads(args.num_threads)
    kestrel, engine_info = run_kestrel(requests, engine_kwargs, args.runs)
    peer = None
    if args.peer == "transformers":
        peer = run_transformers_peer_in_child(PeerJob(
            model_path=engine_info["model_path"], gguf_file=engine_info["gguf_file"],
            dtype=engine_info["dtype"], device=engine_info["device"], requests=requests,
            batch_size=args.peer_batch_size, runs=args.runs, num_threads=args.num_threads))
    report = build_report(args, requests, kestrel, peer, engine_info, started, load_average)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def write_report(report: dict, summary: str, markdown: str, output_json: str | None,
                 append_md: str | None) -> None:
    """Print a benchmark's summary; write its JSON and append its Markdown section when asked."""
    print(summary)
    if output_json:
        Path(output_json).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {output_json}")
    if append_md:
        with open(append_md, "a") as f:
            f.write(markdown)
        log(f"appended to {append_md}")


def check_options(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be at least 1, got {args.peer_batch_size}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")


def set_torch_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def warn_if_busy(load_1min: float) -> None:
    """Other work on the same cores skews every figure, and can stall torch's thread pool badly."""
    cores = len(os.sched_getaffinity(0))
    if load_1min > 0.5 * cores:
        log(f"warning: the machine is busy (1-minute load average {load_1min:.2f} on {cores} cores); "
            "figures will be noisy. With torch's threads contended, --num-threads 1 may be steadier.")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---- results ------------------------------------------------------------------------------------

@dataclass
class EngineResult:
    name: str
    run_wall_s: list[float]
    input_tokens: int
    output_tokens: int            # useful output: each request's own output length
    generated_tokens: int         # what the engine computed, padding to a batch's longest included
    load_s: float
    peak_rss_bytes: int
    rss_after_load_bytes: int
    torch_threads: int
    peak_gpu_memory_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return statistics.median(self.run_wall_s)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "wall_s": self.wall_s, "output_tok_s": self.output_tok_s,
                "total_tok_s": self.total_tok_s}


# ---- memory -------------------------------------------------------------------------------------

def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def peak_rss_bytes() -> int:
    """VmHWM, or ru_maxrss where /proc is missing."""
    kib = _proc_status_kib("VmHWM")
    if kib is None:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def call_sampling_peak_rss(fn: Callable[[], T]) -> tuple[T, int]:
    """fn(), and the largest RSS seen while it ran (sampled every 10 ms, and VmHWM at the end)."""
    peak = current_rss_bytes()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(RSS_SAMPLE_INTERVAL_S):
            peak = max(peak, current_rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, max(peak, current_rss_bytes(), peak_rss_bytes())


def peak_gpu_memory_bytes(device: str) -> int | None:
    import torch
    if not device.startswith("cuda"):
        return None
    return int(torch.cuda.max_memory_allocated(torch.device(device)))


# ---- Kestrel ------------------------------------------------------------------------------------

def run_kestrel(requests: list[BenchRequest], engine_kwargs: dict[str, Any],
                runs: int) -> tuple[EngineResult, dict[str, Any]]:
    """Load Kestrel, warm up, time `runs` generate calls of the whole workload."""
    import torch

    from kestrel.entrypoints.llm import LLM
    log("kestrel: loading")
    start = time.perf_counter()
    llm, load_peak = call_sampling_peak_rss(lambda: LLM(**engine_kwargs))
    load_s = time.perf_counter() - start
    rss_after_load = current_rss_bytes()
    engine_info = describe_engine(llm)
    warm_up_kestrel(llm)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = greedy_params(requests)
    walls, notes = [], []
    for i in range(runs):
        llm.llm_engine.engine_core.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        log(f"kestrel run {i + 1}/{runs}: {walls[-1]:.2f} s, {produced / walls[-1]:.1f} output tok/s")
        expected = sum(r.output_len for r in requests)
        if produced != expected:
            notes.append(f"run {i + 1} produced {produced} output tokens, expected {expected}")
    result = EngineResult(
        name="kestrel", run_wall_s=walls, input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), generated_tokens=sum(r.output_len for r in requests),
        load_s=load_s, peak_rss_bytes=max(load_peak, peak_rss_bytes()), rss_after_load_bytes=rss_after_load,
        torch_threads=torch.get_num_threads(), peak_gpu_memory_bytes=peak_gpu_memory_bytes(engine_info["device"]),
        notes=notes)
    return result, engine_info


def greedy_params(requests: list[BenchRequest]) -> list[Any]:
    from kestrel.sampling_params import SamplingParams
    return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len) for r in requests]


def warm_up_kestrel(llm: Any) -> None:
    """A short generate on prompts unrelated to the workload (another seed), so it warms the code
    paths without seeding the prefix cache."""
    warm = random_requests(2, (16, 32), (4, 4), seed=W1_SEED + 1)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm], greedy_params(warm), use_tqdm=False)


def describe_engine(llm: Any) -> dict[str, Any]:
    engine = llm.llm_engine
    config, source = engine.config, engine.source
    return {
        "model": source.name, "model_path": source.path, "gguf_file": source.gguf_file,
        "format": f"GGUF ({source.gguf_file}, dequantized on load)" if source.gguf_file else "Hugging Face folder",
        "dtype": str(config.model.dtype).removeprefix("torch."), "device": str(config.device.device),
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_model_len": config.model.max_model_len, "block_size": config.cache.block_size,
        "num_kv_blocks": engine.engine_core.num_kv_blocks,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
    }


# ---- transformers peer --------------------------------------------------------------------------

@dataclass
class PeerJob:
    model_path: str
    gguf_file: str | None
    dtype: str
    device: str
    requests: list[BenchRequest]
    batch_size: int
    runs: int
    num_threads: int | None = None


def run_transformers_peer_in_child(job: PeerJob) -> EngineResult:
    """Run the peer in a fresh (spawned) process, so that its memory figures are its own."""
    log("transformers: starting a child process")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_transformers_peer, job).result()


def run_transformers_peer(job: PeerJob) -> EngineResult:
    import torch
    import transformers
    if job.num_threads:
        set_torch_threads(job.num_threads)
    start = time.perf_counter()
    model, load_peak = call_sampling_peak_rss(lambda: load_transformers_model(job))
    load_s = time.perf_counter() - start
    rss_after_load = current_rss_bytes()
    pad_id = padding_token_id(model)
    warm = random_requests(2, (16, 32), (4, 4), seed=W1_SEED + 1)
    generate_batch(model, warm, pad_id, job.device)
    batches = [job.requests[i:i + job.batch_size] for i in range(0, len(job.requests), job.batch_size)]
    walls, generated = [], 0
    for i in range(job.runs):
        start = time.perf_counter()
        generated = sum(generate_batch(model, batch, pad_id, job.device) for batch in batches)
        walls.append(time.perf_counter() - start)
        useful = sum(r.output_len for r in job.requests)
        log(f"transformers run {i + 1}/{job.runs}: {walls[-1]:.2f} s, {useful / walls[-1]:.1f} output tok/s")
    return EngineResult(
        name=f"transformers {transformers.__version__}", run_wall_s=walls,
        input_tokens=sum(r.input_len for r in job.requests), output_tokens=sum(r.output_len for r in job.requests),
        generated_tokens=generated, load_s=load_s, peak_rss_bytes=max(load_peak, peak_rss_bytes()),
        rss_after_load_bytes=rss_after_load, torch_threads=torch.get_num_threads(),
        peak_gpu_memory_bytes=peak_gpu_memory_bytes(job.device),
        notes=[f"batches of {job.batch_size} in request order, left-padded; each batch generates up to its "
               f"longest output ({generated} tokens generated, "
               f"{sum(r.output_len for r in job.requests)} useful)"])


def load_transformers_model(job: PeerJob) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    dtype = getattr(torch, job.dtype)
    log(f"transformers: loading {job.gguf_file or job.model_path} as {job.dtype}")
    if job.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(
            job.model_path, gguf_file=job.gguf_file,
            quantization_config=GgufConfig(gguf_file=job.gguf_file, dequantize=True), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=dtype)
    return model.to(job.device).eval()


def padding_token_id(model: Any) -> int:
    for candidate in (model.generation_config.pad_token_id, model.config.eos_token_id, 0):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def generate_batch(model: Any, batch: list[BenchRequest], pad_id: int, device: str) -> int:
    """Greedy-generate one left-padded batch up to its longest output; returns tokens generated."""
    import torch
    from transformers import GenerationConfig
    max_in = max(r.input_len for r in batch)
    max_out = max(r.output_len for r in batch)
    input_ids = torch.full((len(batch), max_in), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_in), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, max_in - r.input_len:] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, max_in - r.input_len:] = 1
    config = GenerationConfig(do_sample=False, max_new_tokens=max_out, min_new_tokens=max_out,
                              pad_token_id=pad_id, eos_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config)
    generated = (out.shape[1] - max_in) * len(batch)
    if out.shape[1] - max_in != max_out:
        raise RuntimeError(f"transformers generated {out.shape[1] - max_in} tokens, expected {max_out}")
    return generated


# ---- report -------------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    import torch
    import transformers
    cpu_model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu_model == "unknown":
                    cpu_model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    info = {
        "cpu_model": cpu_model, "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
        "bf16_flags": sorted(f for f in flags if "bf16" in f),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def build_report(args: argparse.Namespace, requests: list[BenchRequest], kestrel: EngineResult,
                 peer: EngineResult | None, engine_info: dict[str, Any], started: datetime,
                 load_average: tuple[float, float, float]) -> dict[str, Any]:
    standard = is_standard_w1(len(requests), tuple(args.input_len_range), tuple(args.output_len_range))
    report = {
        "benchmark": "throughput",
        "workload": {
            "id": "W1" if standard else "W1 (reduced)", "num_requests": len(requests),
            "input_len_range": list(args.input_len_range), "output_len_range": list(args.output_len_range),
            "seed": W1_SEED, "input_tokens": kestrel.input_tokens, "output_tokens": kestrel.output_tokens,
            "sampling": "greedy, ignore_eos, max_tokens = output length", "runs": args.runs,
        },
        "command": getattr(args, "command_line", "kestrel bench throughput"),
        "date": started.isoformat(timespec="seconds"),
        "load_average_at_start": list(load_average),
        "load_average_at_end": list(os.getloadavg()),
        "machine": machine_info(),
        "engine": engine_info,
        "kestrel": kestrel.to_dict(),
        "peer": peer.to_dict() if peer else None,
        "ratio_output_tok_s": kestrel.output_tok_s / peer.output_tok_s if peer else None,
    }
    return report


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def _rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = []
    for side in (report["kestrel"], report["peer"]):
        if side:
            rows.append((side["name"], f"{side['wall_s']:.2f}", f"{side['output_tok_s']:.1f}",
                         f"{side['total_tok_s']:.1f}", _gib(side["peak_rss_bytes"])))
    if report["peer"]:
        k, p = report["kestrel"], report["peer"]
        rows.append(("kestrel / peer", f"{k['wall_s'] / p['wall_s']:.2f}", f"{report['ratio_output_tok_s']:.2f}",
                     f"{k['total_tok_s'] / p['total_tok_s']:.2f}", f"{k['peak_rss_bytes'] / p['peak_rss_bytes']:.2f}"))
    return rows


HEADER = ("engine", "wall s", "output tok/s", "total tok/s", "peak RSS")


def format_summary(report: dict[str, Any]) -> str:
    rows = [HEADER, *_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    w, e, m = report["workload"], report["engine"], report["machine"]
    lines += [
        f"workload {w['id']}: {w['num_requests']} requests, {w['input_tokens']} prompt + {w['output_tokens']} "
        f"output tokens; median of {w['runs']} run(s)",
        f"model {e['model']} ({e['format']}), {e['dtype']} on {e['device']}; "
        f"{m['cpu_model']}, {m['usable_cpus']} cpus, bf16 flags: {' '.join(m['bf16_flags']) or 'none'}",
    ]
    for side in (report["kestrel"], report["peer"]):
        for note in (side or {}).get("notes", []):
            lines.append(f"note ({side['name']}): {note}")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    w, e, m = report["workload"], report["engine"], report["machine"]
    table = [f"| {' | '.join(HEADER)} |", "|" + "---|" * len(HEADER)]
    table += [f"| {' | '.join(row)} |" for row in _rows(report)]
    runs = "; ".join(f"{side['name']}: {', '.join(f'{t:.2f}' for t in side['run_wall_s'])} s"
                     for side in (report["kestrel"], report["peer"]) if side)
    lines = [
        "", f"## {w['id']} offline throughput — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'} (torch capability {m['torch_cpu_capability']}); "
        f"torch {m['torch']}, transformers {m['transformers']}; load average at start "
        f"{', '.join(f'{x:.2f}' for x in report['load_average_at_start'])}, at end "
        f"{', '.join(f'{x:.2f}' for x in report['load_average_at_end'])}; torch threads: "
        f"{' / '.join(str(side['torch_threads']) for side in (report['kestrel'], report['peer']) if side)}",
        f"- Model: {e['model']}, {e['format']}, {e['dtype']} on {e['device']}",
        f"- Workload: {w['num_requests']} requests, input {w['input_len_range'][0]}..{w['input_len_range'][1]} "
        f"({w['input_tokens']} tokens), output {w['output_len_range'][0]}..{w['output_len_range'][1]} "
        f"({w['output_tokens']} tokens), seed {w['seed']}, {w['sampling']}; median of {w['runs']} run(s)",
        f"- Kestrel: max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens {e['max_num_batched_tokens']}, "
        f"{e['num_kv_blocks']} KV blocks of {e['block_size']}, prefix caching "
        f"{'on (emptied before each run)' if e['enable_prefix_caching'] else 'off'}, chunked prefill "
        f"{'on' if e['enable_chunked_prefill'] else 'off'}",
        "", *table, "",
        f"Run wall times: {runs}. Only generate is timed (after a short warm-up), not model load.",
    ]
    for side in (report["kestrel"], report["peer"]):
        for note in (side or {}).get("notes", []):
            lines.append(f"Note ({side['name']}): {note}.")
    return "\n".join(lines) + "\n"
