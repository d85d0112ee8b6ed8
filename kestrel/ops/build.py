"""How the CPU kernels are built: one extension per instruction set, compiled from the sources of
`csrc/` with the machine's C++ compiler (about two minutes the first time on 2 cores), cached under
~/.cache/kestrel/kernels (KESTREL_KERNEL_CACHE overrides) and loaded from there afterwards.

Each source is one op family (csrc/decode_attention.cpp, csrc/linear_gguf.cpp, ...) written on the
vector interface that csrc/isa.h picks for the build; csrc/bindings.cpp is the module's Python face.
An extension's build key covers its sources, the headers they include (followed through the
includes), the flags, torch and the CPU, so a changed header rebuilds the extensions that include it
and no other.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import sysconfig
import time
from pathlib import Path
from types import ModuleType

from kestrel import envs, platform

CSRC = Path(__file__).with_name("csrc")
# The sources of every extension, one op family each (bindings.cpp last: it binds them all).
SOURCES = (
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "elementwise.cpp",
    "int8_kv.cpp",
    "linear_float.cpp",
    "linear_bf16_avx512.cpp",
    "linear_gguf.cpp",
    "linear_int8.cpp",
    "decode_layers.cpp",
    "bindings.cpp",
)
_LDFLAGS = ("-fopenmp",)
# The flags of each instruction set's build. The AVX2 build targets x86-64-v3 (AVX2, FMA, no AVX-512)
# even on an AVX-512 CPU, so that what runs here under KESTREL_CPU_KERNELS=avx2 is what a laptop runs;
# -mtune=native still tunes for this CPU. The AVX-512 build takes whatever this CPU has beyond
# AVX-512F (BF16, VNNI, AMX): csrc/isa.h turns the compiler's macros into KESTREL_HAS_*.
ISA_CFLAGS = {
    "avx512": ("-O3", "-march=native", "-fopenmp", "-DKESTREL_VEC_AVX512"),
    "avx2": ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp", "-DKESTREL_VEC_AVX2"),
}
# Part of every build key: a build directory made by an older layout of the sources is never reused.
_LAYOUT = "csrc sources by op family, staged in the build directory"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class KernelBuildError(RuntimeError):
    """The compiler (or ninja) failed on a kernel this CPU can run; the message holds its output."""


def isa_supported(isa: str) -> bool:
    """Whether this CPU runs the `isa` build."""
    return platform.has_avx512() if isa == "avx512" else platform.has_avx2()


def missing_cpu_feature(isa: str) -> str:
    """The CPU feature the `isa` build needs (for skip reasons and messages)."""
    return "AVX-512" if isa == "avx512" else "AVX2 and FMA"


def included_files(source: str) -> list[str]:
    """`source` and every csrc header it includes, followed through the headers' own includes."""
    seen: list[str] = []
    pending = [source]
    while pending:
        name = pending.pop()
        if name in seen or not (CSRC / name).exists():
            continue  # a system header
        seen.append(name)
        pending.extend(_INCLUDE.findall((CSRC / name).read_text()))
    return sorted(seen)


def build_inputs() -> list[str]:
    """Every file of csrc/ that an extension's sources compile: the sources and what they include."""
    return sorted({name for source in SOURCES for name in included_files(source)})


def build_key(isa: str) -> str:
    """What the compiled module depends on: its sources and their headers, the flags, torch (its
    version, and the install whose headers and libraries build.ninja names), the Python headers and
    (through -march=native) the CPU. Each key gets its own build directory, so two checkouts or
    virtual environments, two versions of a kernel or two builds of one source never rebuild each
    other's output."""
    import torch
    digest = hashlib.sha256()
    for name in build_inputs():
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    install = (str(Path(torch.__file__).parent), sysconfig.get_path("include"))
    for part in (*ISA_CFLAGS[isa], *_LDFLAGS, torch.__version__, *install, " ".join(sorted(platform.cpu_flags())),
                 _LAYOUT):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    return envs.KESTREL_KERNEL_CACHE or Path.home() / ".cache" / "kestrel" / "kernels"


def build_dir(isa: str) -> Path:
    """Where the `isa` extension is built: its module name, under the kernel cache."""
    return _cache_root() / f"kestrel_kernels_{isa}_{build_key(isa)}"


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


def _stage_sources(directory: Path) -> list[str]:
    """The sources and headers copied into `directory` (once: a copy's new mtime would make ninja
    rebuild), for the build to compile. torch rebuilds whenever build.ninja changes, and build.ninja
    names the sources' paths: two checkouts of one kernel version share its build directory, and
    compiling from their own paths they rebuilt each other's module on every load."""
    for name in build_inputs():
        staged, partial = directory / name, directory / f"{name}.partial"
        if not staged.exists():
            shutil.copyfile(CSRC / name, partial)
            os.replace(partial, staged)
    return [str(directory / source) for source in SOURCES]


def load_extension(isa: str) -> ModuleType:
    """Build (once per source version, instruction set and machine) and import the `isa` extension.
    Raises KernelBuildError with the compiler's output where the build fails.

    Concurrent loaders (the engine core and a test process, say) serialise on an flock, which the
    kernel releases if its holder dies; torch's own lock file, which a killed build leaves behind
    and which would make every later load wait forever, is removed while the flock is held.
    """
    from torch.utils.cpp_extension import load

    directory = build_dir(isa)
    directory.mkdir(parents=True, exist_ok=True)
    wait_s = envs.KESTREL_KERNEL_BUILD_WAIT_S
    with open(directory / "kestrel.flock", "w") as lock_file:
        if not _acquire(lock_file, wait_s):
            raise TimeoutError(f"another process has been building {directory} for over {wait_s:.0f} s")
        (directory / "lock").unlink(missing_ok=True)
        sources = _stage_sources(directory)
        try:
            return load(name=directory.name, sources=sources, build_directory=str(directory),
                        extra_cflags=list(ISA_CFLAGS[isa]), extra_ldflags=list(_LDFLAGS), verbose=False)
        except (RuntimeError, OSError, ImportError) as exc:
            raise KernelBuildError(f"building the {isa} kernels in {directory} failed: {exc}") from exc
