"""The kernels' AMX code compiles on a CPU without AMX too.

csrc/linear_bf16_avx512.cpp, csrc/prefill_attention.cpp and csrc/decode_attention.cpp (through
decode_bf16_avx512.h) keep their AMX tiles
under `#if defined(__AMX_TILE__) ...`, which the engine's build (-march=native) compiles only on a CPU
with AMX. On the others a change to the code around them (a renamed helper, a changed template) could
break the AMX build unseen until an AMX machine loads it, and there the engine would fall back to the
PyTorch path. Here each source is compiled for Sapphire Rapids (AMX, AVX512-BF16; -O0, which still
checks every intrinsic's instruction set; ~20 s for the three on 2 cores) to assembly, which must
hold AMX instructions. On an AMX CPU the engine's own build is this check, and the kernels' tests run
what it built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from kestrel import ops
from kestrel.ops import build

# The sources with AMX code, each compiled as the AVX-512 build compiles it (build.ISA_CFLAGS).
SOURCES = {source: ("-DKESTREL_VEC_AVX512",)
           for source in ("linear_bf16_avx512.cpp", "prefill_attention.cpp", "decode_attention.cpp")}
AMX_INSTRUCTIONS = ("tdpbf16ps", "tileloadd")
COMPILER = os.environ.get("CXX", "c++")

pytestmark = [
    pytest.mark.slow,
    # On an AMX CPU the engine's own build compiles this code.
    pytest.mark.skipif(ops.cpu_has_amx_tile(), reason="not needed on a CPU with AMX (its own build compiles it)"),
    pytest.mark.skipif(shutil.which(COMPILER) is None,
                       reason="needs Debian's g++" if COMPILER == "c++" else f"needs the compiler {COMPILER}"),
]


def _compiles_for_sapphire_rapids(source: str, flags: tuple[str, ...], out: Path) -> subprocess.Popen:
    """The compiler, started on `source` for Sapphire Rapids, writing its assembly to `out`."""
    includes = [arg for path in (*include_paths(), sysconfig.get_path("include")) for arg in ("-isystem", path)]
    command = [COMPILER, "-std=c++20", "-O0", "-march=sapphirerapids", "-fopenmp", "-fPIC", *flags,
               "-DTORCH_EXTENSION_NAME=amx_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
               "-S", str(build.CSRC / source), "-o", str(out)]
    with open(out.with_suffix(".log"), "w") as log:   # a file, not a pipe that a long log would fill
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def test_the_amx_code_compiles_for_sapphire_rapids(tmp_path):
    probe = subprocess.run([COMPILER, "-march=sapphirerapids", "-x", "c++", "-E", "-dM", "/dev/null"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a {COMPILER} that knows -march=sapphirerapids (GCC 11 or later)")
    assert "__AMX_TILE__" in probe.stdout and "__AMX_BF16__" in probe.stdout
    # Two compilers at a time, one a core (~20 s for the three on 2 cores).
    pending, running = list(SOURCES.items()), []
    try:
        while pending or running:
            while pending and len(running) < 2:
                source, flags = pending.pop(0)
                running.append((source, _compiles_for_sapphire_rapids(source, flags, tmp_path / f"{source}.s")))
            finished = next((r for r in running if r[1].poll() is not None), None)
            if finished is None:
                time.sleep(0.2)
                continue
            running.remove(finished)
            source, compiler = finished
            log = (tmp_path / f"{source}.log").read_text()
            assert compiler.returncode == 0, f"{source} does not compile for AMX:\n{log[-4000:]}"
            text = (tmp_path / f"{source}.s").read_text()
            missing = [name for name in AMX_INSTRUCTIONS if name not in text]
            assert not missing, f"{source} built for AMX has no {', '.join(missing)}: is its AMX code compiled?"
    finally:
        for _, compiler in running:   # a failure leaves no compiler behind
            compiler.kill()
