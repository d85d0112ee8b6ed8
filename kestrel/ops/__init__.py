"""Hand-written CPU kernels, compiled on first use with the machine's C++ compiler (~100 s the first
time on 2 cores), cached under ~/.cache/kestrel/kernels (KESTREL_KERNEL_CACHE overrides).

Each has a pure-PyTorch reference that the tests compare it with, and that runs wherever the kernel
cannot be built (no compiler, or a CPU without the instructions it needs) or when
KESTREL_DISABLE_CPU_KERNELS=1. The attention, norm, rotary, argmax, float32 and bf16 linear kernels
(cpu_kernels.cpp) are one source written on a small vector interface, compiled once per instruction
set: for AVX-512 on vec_avx512.h (16 lanes; AMX where present) and for AVX2 + FMA on vec_avx2.h
(8 lanes). Both builds export the same functions.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sysconfig
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
# The instruction sets cpu_kernels.cpp is built for: the flags that select its vector header. The
# AVX2 build targets x86-64-v3 (AVX2, FMA, no AVX-512) even on an AVX-512 CPU, so that what runs
# here under KESTREL_CPU_KERNELS=avx2 is what a laptop runs; -mtune=native still tunes for this CPU.
ISA_CFLAGS = {
    "avx512": ("-O3", "-march=native", "-fopenmp", "-DKESTREL_VEC_AVX512"),
    "avx2": ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp", "-DKESTREL_VEC_AVX2"),
}
# Part of every build key since builds compile copies of the sources (_staged_source): a build
# directory from before then names a checkout's source path in its build.ninja.
_LAYOUT = "sources staged in the build directory"
# A first build takes ~100 s on 2 cores; a wait far past that means something is wrong.
_BUILD_WAIT_S = float(os.environ.get("KESTREL_KERNEL_BUILD_WAIT_S", "900"))


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def amx_disabled() -> bool:
    """KESTREL_DISABLE_AMX=1: every AMX kernel off (the matmuls, int8 included, and prefill attention)."""
    return os.environ.get("KESTREL_DISABLE_AMX") == "1"


def _cpu_has_avx512() -> bool:
    return "avx512f" in _cpu_flags()


def _cpu_has_avx2() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


def _cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in _cpu_flags()


def cpu_has_amx_tile() -> bool:
    """The CPU lists AMX tiles (whether or not the kernel grants them to this process)."""
    return "amx_tile" in _cpu_flags()


def _kernel_cache_root() -> Path:
    root = os.environ.get("KESTREL_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kestrel" / "kernels"


def _build_key(source: Path, cflags: tuple[str, ...] = _CFLAGS) -> str:
    """What the compiled module depends on: the source and the headers beside it, the flags (the
    instruction set's included), torch (its version, and the install whose headers, libraries and
    Python headers build.ninja names), and (through -march=native) the CPU. Each key gets its own
    build directory, so two checkouts or virtual environments, two versions of a kernel or two
    builds of one source never rebuild each other's output."""
    import torch
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # included by the kernels
        digest.update(header.read_bytes())
    install = (str(Path(torch.__file__).parent), sysconfig.get_path("include"))
    for part in (*cflags, *_LDFLAGS, torch.__version__, *install, " ".join(sorted(_cpu_flags())), _LAYOUT):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _acquire(lock_file, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def extension_build_dir(source_name: str, isa: str | None = None) -> Path:
    """Where ops/<source_name> built for `isa` lives: its module name, under the kernel cache."""
    source = Path(__file__).with_name(source_name)
    cflags = ISA_CFLAGS[isa] if isa is not None else _CFLAGS
    return _kernel_cache_root() / f"kestrel_{source.stem}{'_' + isa if isa else ''}_{_build_key(source, cflags)}"


def load_cpu_extension(source_name: str, isa: str | None = None):
    """Build (once per source version, instruction set and machine) and import the kernel in
    ops/<source_name>, for `isa` (a key of ISA_CFLAGS) where the source is compiled per instruction set.

    Concurrent loaders (the engine core and a test process, say) serialise on an flock, which the
    kernel releases if its holder dies; torch's own lock file, which a killed build leaves behind
    and which would make every later load wait forever, is removed while the flock is held.
    """
    from torch.utils.cpp_extension import load

    source = Path(__file__).with_name(source_name)
    cflags = ISA_CFLAGS[isa] if isa is not None else _CFLAGS
    build_dir = extension_build_dir(source_name, isa)
    name = build_dir.name
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kestrel.flock", "w") as lock_file:
        if not _acquire(lock_file, _BUILD_WAIT_S):
            raise TimeoutError(f"another process has been building {build_dir} for over "
                               f"{_BUILD_WAIT_S:.0f} s")
        (build_dir / "lock").unlink(missing_ok=True)
        staged = _staged_source(source, build_dir)
        return load(name=name, sources=[str(staged)], build_directory=str(build_dir),
                    extra_cflags=list(cflags), extra_ldflags=list(_LDFLAGS), verbose=False)


def _staged_source(source: Path, build_dir: Path) -> Path:
    """`source` and the headers beside it, copied into `build_dir` (once: a copy's new mtime would make
    ninja rebuild), for the build to compile. torch rebuilds whenever build.ninja changes, and
    build.ninja names the source's path: two checkouts of one kernel version share its build
    directory, and compiling from their own paths they rebuilt each other's module on every load."""
    for path in (source, *source.parent.glob("*.h")):
        staged, partial = build_dir / path.name, build_dir / f"{path.name}.partial"
        if not staged.exists():
            shutil.copyfile(path, partial)
            os.replace(partial, staged)
    return build_dir / source.name


def _load_or_none(source_name: str, what: str, usable: bool, isa: str | None = None):
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1" or not usable:
        return None
    try:
        return load_cpu_extension(source_name, isa)
    except Exception as exc:  # no compiler or ninja, the build failed, or it never finished
        logger.warning("%s unavailable, using the PyTorch path: %s", what, exc)
        return None


def cpu_kernels_isa() -> str | None:
    """The build of cpu_kernels() for this CPU: "avx512" before "avx2" (AVX2 + FMA); None without
    either. KESTREL_CPU_KERNELS=avx2 takes the AVX2 build on an AVX-512 CPU too: the path of most
    laptops, run (and tested) on a server."""
    isa = os.environ.get("KESTREL_CPU_KERNELS", "auto")
    if isa not in ("auto", "avx2"):
        raise ValueError(f"KESTREL_CPU_KERNELS must be 'auto' or 'avx2', not {isa!r}")
    if isa == "auto" and _cpu_has_avx512():
        return "avx512"
    return "avx2" if _cpu_has_avx2() else None


def cpu_kernels_source() -> str | None:
    """The source of cpu_kernels() (one for every instruction set, see cpu_kernels_isa()), or None
    where this CPU takes neither build."""
    return "cpu_kernels.cpp" if cpu_kernels_isa() is not None else None


@functools.cache
def cpu_kernels():
    """Paged attention (over the model-dtype or the int8 KV cache), norm, activation, rotary + KV-write,
    argmax, float32 linear, bf16 linear (linear_bf16, for CPUs without AVX512-BF16) and int8 linear
    (--quantization int8; `int8_linear` says whether the build has it: not an AVX-512 CPU without VNNI)
    kernels, and the decode plan's layer loop (DecodeLayers), in
    the build for this CPU (cpu_kernels_isa()), or None where unavailable. Every build has every
    function; `lanes` says the vector width it was compiled for."""
    isa = cpu_kernels_isa()
    return _load_or_none("cpu_kernels.cpp", "CPU attention kernel", isa is not None, isa)


def _avx2_build_loaded() -> bool:
    """Whether cpu_kernels() is its AVX2 build: where the kernels measured faster than torch's own
    float32 paths (which AVX-512 CPUs keep until measured there)."""
    return cpu_kernels_isa() == "avx2" and cpu_kernels() is not None


def linear_f32_preferred() -> bool:
    """Whether float32 decode-sized products (and so the float32 decode plan) take cpu_kernels()'s
    linear_f32 over torch's GEMM: on the AVX2 build, where torch's GEMM runs at a fraction of its
    rate. Both builds have linear_f32; on AVX-512 torch's GEMM (16 lanes) keeps float32 models,
    and so the float32 parity tests, on the path they have always taken."""
    return _avx2_build_loaded()


def prefill_attention_preferred() -> bool:
    """Whether prefill chunks that cpu_prefill()'s kernels do not serve (float32 models; bf16 ones
    without AVX512-BF16) take cpu_kernels()'s prefill_attention over SDPA: on the AVX2 build, where
    SDPA's CPU flash attention reaches 35-70 GFLOP/s and the kernel ~95-125 (2 Zen 3 cores, the
    default model's heads, 128-1024 keys). The AVX-512 build has it too, and its tests run it, but it
    has not been measured against SDPA there, so AVX-512 CPUs keep SDPA."""
    return _avx2_build_loaded()


def cpu_prefers_bf16() -> bool:
    """Whether a model computes at least as fast in bf16 as in float32 on this CPU, which is what
    `--dtype auto` asks: CPUs with bf16 instructions (AVX512-BF16, AMX), and the AVX2 build, whose
    linear_bf16 matches torch's float32 GEMM in prefill and halves the bytes decode reads (measured
    on 2 Zen 3 cores: W1 63 s against 78 s, W3 batch-1 TPOT 0.58x float32's). Without the kernels a
    bf16 model would fall to torch's emulated bf16 GEMM (16-19 GFLOP/s there), so float32."""
    from kestrel.config import cpu_supports_bf16
    return cpu_supports_bf16() or _avx2_build_loaded()


@functools.cache
def cpu_gemv():
    """The small-batch bf16 linear kernel (cpu_gemv.cpp), or None where unavailable (no
    AVX512-BF16, no compiler, or KESTREL_DISABLE_CPU_KERNELS=1)."""
    return _load_or_none("cpu_gemv.cpp", "CPU small-batch linear kernel", _cpu_has_avx512_bf16())


@functools.cache
def cpu_prefill():
    """The prefill-attention kernel (cpu_prefill.cpp: prefill_attention_amx where `amx_usable()`,
    prefill_attention_avx512 on every AVX512-BF16 CPU), or None where unavailable (no AVX512-BF16,
    no compiler, or KESTREL_DISABLE_CPU_KERNELS=1)."""
    return _load_or_none("cpu_prefill.cpp", "CPU prefill-attention kernel", _cpu_has_avx512_bf16())
