"""The CPU this process runs on, probed once: /proc/cpuinfo is read at the first question and cached
for the life of the process (the CPU does not change under it). Where /proc/cpuinfo cannot be read
(not Linux) every flag is absent and the model name is "unknown".

These say what the CPU lists, not what Kestrel will run: whether a kernel is built and loaded, and
whether AMX tiles are granted to this process, is kestrel.ops's question; whether the user turned a
feature off is kestrel.envs's.

A shared leaf module: it imports only the standard library.
"""

from __future__ import annotations

import functools
import os

CPUINFO = "/proc/cpuinfo"


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo."""
    model, flags = "unknown", None
    try:
        with open(CPUINFO) as f:
            for line in f:
                if model == "unknown" and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif flags is None and line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                if model != "unknown" and flags is not None:
                    break
    except OSError:
        pass
    return model, flags or frozenset()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's `flags` line), empty where unknown."""
    return _cpuinfo()[1]


def cpu_model_name() -> str:
    """The CPU's model name, "unknown" where it cannot be read."""
    return _cpuinfo()[0]


def has_avx2() -> bool:
    """AVX2 and FMA: what the AVX2 build of the kernels needs (x86-64-v3)."""
    return {"avx2", "fma"} <= cpu_flags()


def has_avx512() -> bool:
    """AVX-512 Foundation: what the AVX-512 build of the kernels needs."""
    return "avx512f" in cpu_flags()


def has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


def has_avx512_vnni() -> bool:
    return "avx512_vnni" in cpu_flags()


def has_amx_tile() -> bool:
    """The CPU lists AMX tiles (whether or not the OS grants them to this process)."""
    return "amx_tile" in cpu_flags()


def has_amx_bf16() -> bool:
    return "amx_bf16" in cpu_flags()


def has_amx_int8() -> bool:
    return "amx_int8" in cpu_flags()


def has_bf16_instructions() -> bool:
    """Native bf16 arithmetic: AVX512-BF16 or AMX-BF16."""
    return has_avx512_bf16() or has_amx_bf16()


def bf16_flags() -> list[str]:
    """The flags that name bf16 (for reports)."""
    return sorted(f for f in cpu_flags() if "bf16" in f)


def logical_cpus() -> int | None:
    return os.cpu_count()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0))
