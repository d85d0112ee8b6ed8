"""`kestrel bench throughput`: workloads W1 (offline throughput) and W4 (shared prefix), against peers.

W4 (`--workload W4`): 64 requests sharing a 512-token prefix, each with 32 tokens of its own and 32
output tokens. Kestrel runs it twice, prefix caching on and off, and reports wall time and mean TTFT
(first token time minus arrival, from each request's metrics) for both.

Peers `llama-server[:bf16|:f32|:q4_1]` (kestrel/bench/launch.py): llama.cpp's server on the same
weights written in that precision (by default Kestrel's own dtype here: bf16, or f32 on a CPU
without bf16 instructions), or its native Q4_1 file. Every request is sent at once through the same
OpenAI-compatible client as `kestrel bench serve` (kestrel/bench/serve.py): W1 non-streaming with
`cache_prompt: false`; W4 streaming (for TTFT) with `cache_prompt: true`. Its peak memory is its
process's, sampled.

The machine's limits (kestrel/bench/roofline.py) are measured in the same run, before the engines:
bf16 and fp32 matmul GFLOP/s at the model's layer shapes and the copy rate; Kestrel's achieved
GFLOP/s on the workload (prompt tokens x 2 x non-embedding parameters + output tokens x 2 x all
parameters) is reported as a fraction of the rate in the model's dtype (bf16; float32 where the model
runs in float32, as on a CPU without bf16 instructions). That rate is measured again just before each
of Kestrel's timed runs, and each run's fraction of it is reported too, with their median: an AMX
machine's rate drifts between runs.

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
import functools
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

from kestrel.bench.launch import PEER_SPECS, peer_label
from kestrel.bench.report import load_averages, markdown_table, text_table
from kestrel.bench.workloads import (W1_INPUT_LEN_RANGE, W1_NUM_REQUESTS, W1_OUTPUT_LEN_RANGE, W1_SEED,
                                     BenchRequest, is_standard_w1, random_requests, w1_offline_throughput,
                                     W4_PREFIX_LEN, W4_UNIQUE_LEN, w4_shared_prefix)

PEERS = ("transformers", *PEER_SPECS)
WORKLOADS = ("W1", "W4")
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
    parser.add_argument("--workload", choices=WORKLOADS, default="W1",
                        help="W1 (offline throughput) or W4 (shared prefix, caching on vs off) (default: W1)")
    parser.add_argument("--peer", action="append", choices=PEERS, default=[],
                        help="also run this peer (repeatable): transformers on the same weights and dtype; "
                             "llama-server on the weights written as bf16 or f32 (default: Kestrel's dtype here), "
                             "or its native q4_1 file")
    parser.add_argument("--no-roofline", dest="roofline", action="store_false",
                        help="skip measuring the machine's matmul and copy rates (W1 only: W4 never does)")
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
    if args.workload == "W4":
        requests = w4_shared_prefix()
    else:
        requests = w1_offline_throughput(args.num_prompts, tuple(args.input_len_range),
                                         tuple(args.output_len_range))
    log(f"workload {args.workload}: {len(requests)} requests, {sum(r.input_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens")
    started = datetime.now(timezone.utc)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    if args.num_threads:
        set_torch_threads(args.num_threads)
    limits = rate_before_run = None
    # W4's first engine skips the prefill its prefix cache holds: W1's FLOP count would not apply.
    if args.roofline and args.workload == "W1":
        limits = measure_machine_limits(engine_kwargs)
        from kestrel.bench.roofline import gflops_of
        rate_before_run = functools.partial(gflops_of, [tuple(x) for x in limits["shapes"]], limits["roofline_dtype"])
    results, engine_info = run_kestrel(requests, engine_kwargs, args.runs, args.workload, rate_before_run)
    for peer in args.peer:
        if peer == "transformers":
            results.append(run_transformers_peer_in_child(PeerJob(
                model_path=engine_info["model_path"], gguf_file=engine_info["gguf_file"],
                dtype=engine_info["dtype"], device=engine_info["device"], requests=requests,
                batch_size=args.peer_batch_size, runs=args.runs, num_threads=args.num_threads)))
        else:
            results.append(run_server_peer(peer, requests, args.runs, args.workload, engine_kwargs.get("model")))
    report = build_report(args, requests, results, engine_info, started, load_average, limits)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def measure_machine_limits(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from kestrel.bench.roofline import (kv_bytes_per_token, layer_shapes, measure_limits, model_param_counts,
                                        roofline_dtype)
    from kestrel.config import resolve_device, resolve_dtype
    from kestrel.model.loader import load_config, resolve_model
    hf_config = load_config(resolve_model(engine_kwargs.get("model")))
    log("measuring the machine's matmul, copy and read rates")
    limits = measure_limits(layer_shapes(hf_config)).to_dict()
    params = model_param_counts(hf_config)
    dtype = resolve_dtype(engine_kwargs.get("dtype") or "auto", resolve_device(engine_kwargs.get("device") or "auto"))
    dtype_bytes = dtype.itemsize
    # --quantization int8 stores the decoder's projections in one byte (the output head stays).
    layer_bytes = 1 if engine_kwargs.get("quantization") == "int8" else dtype_bytes
    limits.update(non_embedding_params=params.non_embedding, output_head_params=params.output_head,
                  roofline_dtype=roofline_dtype(str(dtype).removeprefix("torch.")),
                  weight_bytes=params.non_embedding * layer_bytes + params.output_head * dtype_bytes,
                  kv_bytes_per_token=kv_bytes_per_token(hf_config, engine_kwargs.get("kv_cache_dtype") or "auto",
                                                        dtype_bytes))
    log(f"bf16 matmul {limits['bf16_gflops']:.0f} GFLOP/s, fp32 {limits['fp32_gflops']:.0f} GFLOP/s, "
        f"copy {limits['copy_gb_s']:.1f} GB/s, read {limits['read_gb_s']:.1f} GB/s")
    return limits


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
    run_mean_ttft_s: list[float] = field(default_factory=list)   # per run; W4 (and streamed peers)
    run_roofline_gflops: list[float] = field(default_factory=list)  # the matmul rate measured just before each run

    @property
    def mean_ttft_s(self) -> float | None:
        return statistics.median(self.run_mean_ttft_s) if self.run_mean_ttft_s else None

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
                "total_tok_s": self.total_tok_s, "mean_ttft_s": self.mean_ttft_s}


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

def run_kestrel(requests: list[BenchRequest], engine_kwargs: dict[str, Any], runs: int,
                workload: str = "W1", rate_before_run: Callable[[], float] | None = None
                ) -> tuple[list[EngineResult], dict[str, Any]]:
    """Load Kestrel, warm up, time `runs` generate calls of the whole workload; for W4, again with
    prefix caching off (a second engine). `rate_before_run` (W1): called before each timed run, its
    value (the matmul rate in the model's dtype) kept beside the run's wall time."""
    if workload != "W4":
        result, info = _run_kestrel_once(requests, engine_kwargs, runs, "kestrel", rate_before_run)
        return [result], info
    on, info = _run_kestrel_once(requests, {**engine_kwargs, "enable_prefix_caching": True}, runs,
                                 "kestrel, prefix caching on")
    off, _ = _run_kestrel_once(requests, {**engine_kwargs, "enable_prefix_caching": False}, runs,
                               "kestrel, prefix caching off")
    return [on, off], info


def _run_kestrel_once(requests: list[BenchRequest], engine_kwargs: dict[str, Any], runs: int,
                      name: str, rate_before_run: Callable[[], float] | None = None
                      ) -> tuple[EngineResult, dict[str, Any]]:
    import gc

    import torch

    from kestrel.entrypoints.llm import LLM
    log(f"{name}: loading")
    start = time.perf_counter()
    llm, load_peak = call_sampling_peak_rss(lambda: LLM(**engine_kwargs))
    load_s = time.perf_counter() - start
    rss_after_load = current_rss_bytes()
    engine_info = describe_engine(llm)
    warm_up_kestrel(llm)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = greedy_params(requests)
    walls, ttfts, notes, rates = [], [], [], []
    for i in range(runs):
        if rate_before_run is not None:
            rates.append(rate_before_run())
            log(f"matmul {rates[-1]:.0f} GFLOP/s before run {i + 1}")
        llm.llm_engine.engine_core.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        ttfts.append(statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs))
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        log(f"{name} run {i + 1}/{runs}: {walls[-1]:.2f} s, {produced / walls[-1]:.1f} output tok/s, "
            f"mean TTFT {ttfts[-1] * 1e3:.0f} ms")
        expected = sum(r.output_len for r in requests)
        if produced != expected:
            notes.append(f"run {i + 1} produced {produced} output tokens, expected {expected}")
    result = EngineResult(
        name=name, run_wall_s=walls, input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), generated_tokens=sum(r.output_len for r in requests),
        load_s=load_s, peak_rss_bytes=max(load_peak, peak_rss_bytes()), rss_after_load_bytes=rss_after_load,
        torch_threads=torch.get_num_threads(), peak_gpu_memory_bytes=peak_gpu_memory_bytes(engine_info["device"]),
        notes=notes, run_mean_ttft_s=ttfts, run_roofline_gflops=rates)
    del llm
    gc.collect()
    return result, engine_info


def run_server_peer(spec: str, requests: list[BenchRequest], runs: int, workload: str,
                    model: str | None) -> EngineResult:
    """A server peer (llama-server) on the whole workload at once, through the benchmark client."""
    import asyncio

    from kestrel.bench.launch import launch_server
    from kestrel.bench.peers import RssSampler
    from kestrel.bench.serve import Target, resolve_model, send_requests
    ctx = max(r.input_len + r.output_len for r in requests) + 16
    server = launch_server(spec, parallel=len(requests), ctx_per_slot=ctx, model=model)
    log(f"{server.label}: starting")
    start = time.perf_counter()
    with server, RssSampler(server.pid) as rss:
        load_s = time.perf_counter() - start
        rss_after_load = rss.sample()
        w4 = workload == "W4"
        target = Target(server.base_url, stream=w4, extra_body={"cache_prompt": w4})
        name, _ = asyncio.run(resolve_model(target))
        warm = random_requests(2, (16, 32), (4, 4), seed=W1_SEED + 1)
        asyncio.run(send_requests(target, name, warm, [0.0] * len(warm)))
        walls, ttfts, notes = [], [], []
        for i in range(runs):
            results, wall = asyncio.run(send_requests(target, name, requests, [0.0] * len(requests)))
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{server.label}: {len(failed)} request(s) failed, e.g. {failed[0]}")
            produced = sum(r.output_tokens for r in results)
            walls.append(wall)
            if w4:
                ttfts.append(statistics.mean(r.ttft_s for r in results))
            log(f"{server.label} run {i + 1}/{runs}: {wall:.2f} s, {produced / wall:.1f} output tok/s")
            expected = sum(r.output_len for r in requests)
            if produced != expected:
                notes.append(f"run {i + 1} produced {produced} output tokens, expected {expected}")
        peak = rss.peak
    notes.insert(0, server.label)
    return EngineResult(
        name=peer_label(spec), run_wall_s=walls, input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), generated_tokens=sum(r.output_len for r in requests),
        load_s=load_s, peak_rss_bytes=peak, rss_after_load_bytes=rss_after_load,
        torch_threads=getattr(server, "threads", 0), notes=notes, run_mean_ttft_s=ttfts)


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
        "quantization": config.model.quantization, "kv_cache_dtype": config.cache.kv_cache_dtype,
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


def build_report(args: argparse.Namespace, requests: list[BenchRequest], results: list[EngineResult],
                 engine_info: dict[str, Any], started: datetime, load_average: tuple[float, float, float],
                 limits: dict[str, Any] | None = None) -> dict[str, Any]:
    if args.workload == "W4":
        workload_id = "W4"
        shape = {"prefix_len": W4_PREFIX_LEN, "unique_len": W4_UNIQUE_LEN}
    else:
        standard = is_standard_w1(len(requests), tuple(args.input_len_range), tuple(args.output_len_range))
        workload_id = "W1" if standard else "W1 (reduced)"
        shape = {"input_len_range": list(args.input_len_range), "output_len_range": list(args.output_len_range)}
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
            f"**{100 * r['fraction_of_roofline']:.0f}% of the {_short(r['roofline_dtype'])} roofline** (the limit would run it in "
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
        f"model {e['model']} ({e['format']}), {_precision(e)} on {e['device']}; "
        f"{m['cpu_model']}, {m['usable_cpus']} cpus, bf16 flags: {' '.join(m['bf16_flags']) or 'none'}",
    ]
    if (line := _roofline_line(report)) is not None:
        lines.append(line.replace("**", ""))
    for side in report["results"]:
        for note in side.get("notes", []):
            lines.append(f"note ({side['name']}): {note}")
    return "\n".join(lines)


def _workload_line(w: dict[str, Any]) -> str:
    if w["id"] == "W4":
        return (f"{w['num_requests']} requests sharing a {w['prefix_len']}-token prefix, each with "
                f"{w['unique_len']} tokens of its own ({w['input_tokens']} prompt tokens), "
                f"{w['output_tokens']} output tokens in all, {w['sampling']}; median of {w['runs']} run(s)")
    return (f"{w['num_requests']} requests, input {w['input_len_range'][0]}..{w['input_len_range'][1]} "
            f"({w['input_tokens']} tokens), output {w['output_len_range'][0]}..{w['output_len_range'][1]} "
            f"({w['output_tokens']} tokens), seed {w['seed']}, {w['sampling']}; median of {w['runs']} run(s)")


def format_markdown(report: dict[str, Any]) -> str:
    w, e, m = report["workload"], report["engine"], report["machine"]
    table = markdown_table(HEADER, _rows(report))
    runs = "; ".join(f"{side['name']}: {', '.join(f'{t:.2f}' for t in side['run_wall_s'])} s"
                     for side in report["results"])
    title = "offline throughput" if w["id"].startswith("W1") else "shared prefix"
    lines = [
        "", f"## {w['id']} {title} — {report['date']}", "",
        f"- Command: `{report['command']}`",
        f"- Machine: {m['cpu_model']}, {m['usable_cpus']} usable cpus, bf16 flags: "
        f"{' '.join(m['bf16_flags']) or 'none'} (torch capability {m['torch_cpu_capability']}); "
        f"torch {m['torch']}, transformers {m['transformers']}; "
        f"{load_averages(report)}; threads: "
        + ", ".join(f"{side['name']} {side['torch_threads']}" for side in report["results"]),
        f"- Model: {e['model']}, {e['format']}, {_precision(e)} on {e['device']}",
        f"- Workload: {_workload_line(w)}",
        f"- Kestrel: max_num_seqs {e['max_num_seqs']}, max_num_batched_tokens {e['max_num_batched_tokens']}, "
        f"{e['num_kv_blocks']} KV blocks of {e['block_size']}, prefix caching emptied before each run, "
        f"chunked prefill {'on' if e['enable_chunked_prefill'] else 'off'}; in-process `LLM.generate`. "
        "llama-server peers: every request at once through the benchmark's HTTP client "
        "(W1: non-streaming, cache_prompt false; W4: streaming, cache_prompt true)",
        "", *table, "",
        f"Run wall times: {runs}. Only generation is timed (after a short warm-up), not model load.",
    ]
    if (line := _roofline_line(report)) is not None:
        lines += ["", line + "."]
    for side in report["results"]:
        for note in side.get("notes", []):
            lines.append(f"Note ({side['name']}): {note}.")
    return "\n".join(lines) + "\n"
