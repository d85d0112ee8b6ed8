"""Hand-written CPU kernels, compiled on first use with the machine's C++ compiler (cached by torch
under TORCH_EXTENSIONS_DIR, ~40 s the first time).

Each has a pure-PyTorch reference in kestrel/model/attention.py that the tests compare it with,
and that runs wherever the kernel cannot be built (no compiler, no AVX-512) or when
KESTREL_DISABLE_CPU_KERNELS=1.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f " in f.read()
    except OSError:
        return False


@functools.cache
def cpu_kernels():
    """The compiled extension module, or None when it is unavailable."""
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1" or not _cpu_has_avx512():
        return None
    try:
        from torch.utils.cpp_extension import load
        source = Path(__file__).with_name("cpu_kernels.cpp")
        return load(name="kestrel_cpu_ops", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler or ninja, or the build failed
        logger.warning("CPU attention kernel unavailable, using the PyTorch path: %s", exc)
        return None


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512_bf16 " in f.read()
    except OSError:
        return False


@functools.cache
def cpu_gemv():
    """The small-batch bf16 linear kernel (cpu_gemv.cpp), or None where it is unavailable (no
    AVX512-BF16, no compiler, or KESTREL_DISABLE_CPU_KERNELS=1)."""
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1" or not _cpu_has_avx512_bf16():
        return None
    try:
        from torch.utils.cpp_extension import load
        source = Path(__file__).with_name("cpu_gemv.cpp")
        return load(name="kestrel_cpu_gemv", sources=[str(source)],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    verbose=False)
    except Exception as exc:  # no compiler or ninja, or the build failed
        logger.warning("CPU small-batch linear kernel unavailable, using torch's linear: %s", exc)
        return None
