"""The transformers peer of the throughput benchmark: `model.generate` on the same weights and dtype,
in batches, in a child process of its own. See kestrel/bench/throughput.py."""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from kestrel.bench.common import (
    EngineResult,
    call_sampling_peak_rss,
    current_rss_bytes,
    log,
    peak_gpu_memory_bytes,
    peak_rss_bytes,
    set_torch_threads,
)
from kestrel.bench.workloads import BenchRequest, warm_up_requests


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
    warm = warm_up_requests()
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
        name=f"transformers {transformers.__version__} {job.dtype}", run_wall_s=walls,
        input_tokens=sum(r.input_len for r in job.requests), output_tokens=sum(r.output_len for r in job.requests),
        generated_tokens=generated, load_s=load_s, peak_rss_bytes=max(load_peak, peak_rss_bytes()),
        rss_after_load_bytes=rss_after_load, torch_threads=torch.get_num_threads(),
        peak_gpu_memory_bytes=peak_gpu_memory_bytes(job.device),
        notes=[f"read {os.path.join(job.model_path, job.gguf_file) if job.gguf_file else job.model_path}",
               f"batches of {job.batch_size} in request order, left-padded; each batch generates up to its "
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
