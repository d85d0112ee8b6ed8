"""Hand-written CPU kernels: one extension per instruction set, built from csrc/ on first use (see
kestrel/ops/build.py) and picked once per process here; docs/kernels.md maps the sources.

Every kernel has a pure-PyTorch reference that the tests compare it with. The engine takes the
reference where no kernel can run: a CPU without AVX2, KESTREL_DISABLE_CPU_KERNELS=1, or a machine
without a working compiler, which is said in a warning at start-up. A kernel that fails to build on a
CPU that can run it raises instead where KESTREL_STRICT_KERNELS=1 (the tests set it), so that a
broken kernel fails the suite rather than skipping its tests.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

from kestrel import envs, platform
from kestrel.ops import build
from kestrel.ops.build import KernelBuildError

__all__ = [
    "KernelBuildError", "amx_disabled", "cpu_gemv", "cpu_has_amx_tile", "cpu_kernels",
    "cpu_kernels_isa", "cpu_prefers_bf16", "cpu_prefill", "linear_f32_preferred", "prefill_attention_preferred",
]

logger = logging.getLogger(__name__)


def amx_disabled() -> bool:
    """KESTREL_DISABLE_AMX=1: every AMX kernel off (the matmuls, int8 included, and prefill attention)."""
    return envs.KESTREL_DISABLE_AMX


def cpu_has_amx_tile() -> bool:
    """The CPU lists AMX tiles (whether or not the kernel grants them to this process)."""
    return platform.has_amx_tile()


def cpu_kernels_isa() -> str | None:
    """The build of cpu_kernels() for this CPU: "avx512" before "avx2" (AVX2 + FMA); None without
    either. KESTREL_CPU_KERNELS=avx2 takes the AVX2 build on an AVX-512 CPU too: the path of most
    laptops, run (and tested) on a server."""
    if envs.KESTREL_CPU_KERNELS == "auto" and build.isa_supported("avx512"):
        return "avx512"
    return "avx2" if build.isa_supported("avx2") else None


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """This CPU's kernel extension (the build cpu_kernels_isa() names), or None where the engine runs
    the PyTorch references instead. Every build has the kernels of csrc/kernels.h on its vector
    interface; `lanes` is its vector width, `int8_linear` and `avx512_bf16` say whether it has
    linear_int8 and the AVX512-BF16 / AMX kernels."""
    isa = cpu_kernels_isa()
    if isa is None or envs.KESTREL_DISABLE_CPU_KERNELS:
        return None
    try:
        return build.load_extension(isa)
    except (KernelBuildError, TimeoutError) as exc:
        if envs.KESTREL_STRICT_KERNELS:
            raise
        logger.warning("the CPU kernels are unavailable, so the PyTorch path runs (slower): %s", exc)
        return None


def _avx2_build_loaded() -> bool:
    """Whether cpu_kernels() is its AVX2 build: where the kernels measured faster than torch's own
    float32 paths (which AVX-512 CPUs keep until measured there)."""
    return cpu_kernels_isa() == "avx2" and cpu_kernels() is not None


def linear_f32_preferred() -> bool:
    """Whether float32 decode-sized products (and so the float32 decode plan) take cpu_kernels()'s
    linear_f32 over torch's GEMM: on the AVX2 build, where torch's GEMM runs at a fraction of its
    rate at decode sizes (docs/kernels.md). Both builds have linear_f32; on AVX-512 torch's GEMM
    (16 lanes) keeps float32 models, and so the float32 parity tests, on the path they have always taken."""
    return _avx2_build_loaded()


def prefill_attention_preferred() -> bool:
    """Whether prefill chunks that cpu_prefill()'s kernels do not serve (float32 models; bf16 ones
    without AVX512-BF16) take cpu_kernels()'s prefill_attention over SDPA: on the AVX2 build, where it
    measured faster than SDPA's CPU flash attention (docs/kernels.md). The AVX-512 build has it too,
    and its tests run it, but it has not been measured against SDPA there, so AVX-512 CPUs keep SDPA."""
    return _avx2_build_loaded()


def cpu_prefers_bf16() -> bool:
    """Whether a model computes at least as fast in bf16 as in float32 on this CPU, which is what
    `--dtype auto` asks: CPUs with bf16 instructions (AVX512-BF16, AMX), and the AVX2 build, whose
    linear_bf16 keeps up with torch's float32 GEMM in prefill and halves the bytes decode reads
    (docs/kernels.md). Without the kernels a bf16 model would fall to torch's emulated bf16 GEMM, a
    fraction of its float32 rate, so float32."""
    from kestrel.config import cpu_supports_bf16
    return cpu_supports_bf16() or _avx2_build_loaded()


def _bf16_kernels() -> ModuleType | None:
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.avx512_bf16 else None


def cpu_gemv() -> ModuleType | None:
    """cpu_kernels() where it has the bf16 products on bf16 instructions (linear_bf16_avx512, and the
    AMX ones where amx_usable()): a CPU with AVX512-BF16; else None."""
    return _bf16_kernels()


def cpu_prefill() -> ModuleType | None:
    """cpu_kernels() where it has the bf16 prefill attention kernels (prefill_attention_amx where
    amx_usable(), prefill_attention_avx512): a CPU with AVX512-BF16; else None."""
    return _bf16_kernels()
