"""How a machine's CPU cores are split between the processes that compute on them.

Each CPU worker (every tensor x pipeline rank of every data-parallel engine core on the machine) gets
its own slice of the cores this process may use, pins itself to it and sizes its thread pool to it:
two thread pools on the same cores slow each other far more than twice. With more workers than cores
they share cores round-robin, one thread each (a warning says so).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kestrel.config import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSlice:
    cores: tuple[int, ...]
    shared: bool                # more workers than cores: some cores serve two workers

    @property
    def num_threads(self) -> int:
        return len(self.cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_slice(index: int, count: int, cores: list[int] | None = None) -> CpuSlice:
    """The cores of worker `index` of `count` on this machine: consecutive, as even as possible."""
    cores = available_cores() if cores is None else cores
    if not 0 <= index < count:
        raise ValueError(f"worker {index} is outside {count} workers")
    if count > len(cores):
        return CpuSlice((cores[index % len(cores)],), shared=True)
    base, extra = divmod(len(cores), count)
    start = index * base + min(index, extra)
    return CpuSlice(tuple(cores[start:start + base + (1 if index < extra else 0)]), shared=False)


def bind_to_cpu_slice(index: int, count: int, label: str) -> CpuSlice:
    """Pin this process to its slice and size torch's thread pool to it; logs what it chose."""
    chosen = cpu_slice(index, count)
    os.sched_setaffinity(0, chosen.cores)
    torch.set_num_threads(chosen.num_threads)
    log = logger.warning if chosen.shared else logger.info
    log("%s: cores %s, %d thread%s%s", label, ",".join(map(str, chosen.cores)), chosen.num_threads,
        "" if chosen.num_threads == 1 else "s",
        " (more workers than cores: cores are shared)" if chosen.shared else "")
    return chosen


def engine_core_cpu_slice(parallel: ParallelConfig) -> CpuSlice | None:
    """The cores of a data-parallel engine core whose one worker runs in its own process (backend uni):
    slice `data_parallel_rank` of `data_parallel_size`. None when it binds nothing: a single engine core
    keeps every core, and the workers of the other backends bind themselves."""
    if parallel.data_parallel_size == 1 or parallel.distributed_executor_backend != "uni":
        return None
    return cpu_slice(parallel.data_parallel_rank, parallel.data_parallel_size)


def bind_engine_core(parallel: ParallelConfig) -> CpuSlice | None:
    """Pin a data-parallel engine core (see engine_core_cpu_slice) to its slice, before it builds its
    engine; None when it binds nothing."""
    if engine_core_cpu_slice(parallel) is None:
        return None
    rank = parallel.data_parallel_rank
    return bind_to_cpu_slice(rank, parallel.data_parallel_size, f"engine core {rank}")
