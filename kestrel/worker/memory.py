"""How many KV blocks fit: measured after a profile forward pass, never guessed.

CPU: the budget is `kv_cache_memory` bytes per worker when given (as vLLM's CPU backend counts it),
else the smaller of 4 GiB (vLLM's CPU default) and this worker's share of 90% of the RAM still
available once weights are loaded and the profile's peak activations are set aside. Where the pool's
size is stated (`kv_cache_memory` or `num_kv_blocks`), the profile could not change it, so it is not
run (vLLM's CPU backend never runs one): a forward pass at the largest batch costs ~1 s on a CPU even
through the two layers it runs (ModelRunner.profile_run); stated bytes are still checked against
the free RAM. CUDA:
`gpu_memory_utilization` × device memory, minus the peak that torch saw during the profile and what
other allocations hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from kestrel.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kestrel.ops.huge_pages import return_freed_memory

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    kv_budget_bytes: int
    activation_peak_bytes: int
    free_bytes: int            # what the device had left after the profile, activations set aside


def _rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set size
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
    return int(match.group(1)) * 1024 if match else _rss_bytes()


def profile_cpu(config: EngineConfig, run_profile: Callable[[], None]) -> MemoryProfile:
    if _pool_size_is_stated(config):
        return _stated_cpu_budget(config)
    # Freed heap memory still resident would take the profile's allocations without raising the RSS,
    # and the peak would read low.
    return_freed_memory()
    before = _rss_bytes()
    can_measure_peak = _reset_peak_rss()
    run_profile()
    peak = _peak_rss_bytes() if can_measure_peak else _rss_bytes()
    activation = max(0, peak - before)
    free = psutil.virtual_memory().available - activation
    # Every worker on this machine sees the same free RAM: each takes its share of it.
    budget = min(DEFAULT_CPU_KV_CACHE_BYTES, int(0.9 * free) // config.parallel.num_local_workers)
    return MemoryProfile(budget, activation, free)


def _pool_size_is_stated(config: EngineConfig) -> bool:
    """Whether the user fixed the KV pool's size, in bytes or in blocks."""
    return config.cache.kv_cache_memory is not None or config.cache.num_kv_blocks is not None


def _stated_cpu_budget(config: EngineConfig) -> MemoryProfile:
    """The stated pool without a profile: its bytes must fit in the RAM that is free now."""
    free = psutil.virtual_memory().available
    budget = config.cache.kv_cache_memory
    if budget is not None and budget > free:
        raise ValueError(f"--kv-cache-memory asks for {budget / GiB:.2f} GiB but only {free / GiB:.2f} GiB "
                         f"of RAM is free after loading the model; lower --kv-cache-memory")
    return MemoryProfile(budget if budget is not None else 0, 0, free)


def profile_cuda(config: EngineConfig, run_profile: Callable[[], None]) -> MemoryProfile:
    device = config.device.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    allocated_before = torch.cuda.memory_allocated(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    # Memory used outside torch's allocator (CUDA context, other processes) counts against us too.
    non_torch = (total - free_before) - torch.cuda.memory_reserved(device)
    activation = peak - allocated_before
    if config.cache.kv_cache_memory is not None:
        budget = config.cache.kv_cache_memory
    else:
        budget = int(total * config.cache.gpu_memory_utilization) - peak - max(0, non_torch)
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info(device)
    return MemoryProfile(max(0, budget), activation, free_after)


def num_blocks_for(config: EngineConfig, profile: MemoryProfile, kv_bytes_per_token: int) -> int:
    """Blocks in the pool, block 0 (the null block) included; errors name the knob to turn.
    `kv_bytes_per_token`: what this worker holds of one token's K and V (its layers, its KV heads)."""
    cache = config.cache
    bytes_per_block = cache.block_size * kv_bytes_per_token
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
    else:
        num_blocks = profile.kv_budget_bytes // bytes_per_block
    needed = config.model.kv_groups.max_blocks_held(config.scheduler.max_model_len, cache.block_size,
                                                    config.scheduler.max_num_batched_tokens) + 1
    if num_blocks < needed:
        knob = ("--num-kv-blocks" if cache.num_kv_blocks is not None
                else "--kv-cache-memory" if cache.kv_cache_memory is not None or config.device.device.type == "cpu"
                else "--gpu-memory-utilization")
        raise ValueError(
            f"the KV cache has room for {max(num_blocks - 1, 0) * cache.block_size} tokens "
            f"({num_blocks} blocks of {cache.block_size}, {num_blocks * bytes_per_block / GiB:.3f} GiB), "
            f"fewer than one sequence of max_model_len={config.scheduler.max_model_len} needs "
            f"({needed} blocks); raise {knob} or lower --max-model-len")
    return num_blocks
