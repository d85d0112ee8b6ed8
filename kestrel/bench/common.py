"""Helpers every benchmark shares: progress lines on stderr, the machine's description, a busy-machine
warning, torch's thread count, resident-memory sampling, and one engine's timed result."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

RSS_SAMPLE_INTERVAL_S = 0.01

T = TypeVar("T")


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


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    from kestrel import platform as cpu
    info = {
        "cpu_model": cpu.cpu_model_name(), "logical_cpus": cpu.logical_cpus(), "usable_cpus": cpu.usable_cpus(),
        "bf16_flags": cpu.bf16_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
