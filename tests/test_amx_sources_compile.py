"""The kernels' AMX code compiles on a CPU without AMX too.

cpu_gemv.cpp, cpu_prefill.cpp and cpu_kernels.cpp (through decode_bf16_avx512.h) keep their AMX tiles
under `#if defined(__AMX_TILE__) ...`, which the engine's build (-march=native) compiles only on a CPU
with AMX. On the others a change to the code around them (a renamed helper, a changed template) could
break the AMX build unseen until an AMX machine loads it, and there the engine would fall back to the
PyTorch path. Here each source is compiled for Sapphire Rapids (AMX, AVX512-BF16; -O0, which still
checks every intrinsic's instruction set; ~65 s for the three on 2 cores) to assembly, which must
hold AMX instructions. On an AMX CPU the engine's own build is this check, and the kernels' tests run
what it built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from kestrel import ops

SOURCES = {   # source: what selects its AVX-512 code (ops.ISA_CFLAGS for the per-ISA one)
    "cpu_gemv.cpp": (),
    "cpu_prefill.cpp": (),
    "cpu_kernels.cpp": ("-DKESTREL_VEC_AVX512",),
}
AMX_INSTRUCTIONS = ("tdpbf16ps", "tileloadd")
COMPILER = os.environ.get("CXX", "c++")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ops.cpu_has_amx_tile(), reason="an AMX CPU: the engine's own build compiles this code"),
    pytest.mark.skipif(shutil.which(COMPILER) is None, reason="needs a C++ compiler"),
]


def _compiles_for_sapphire_rapids(source: str, flags: tuple[str, ...], out: Path) -> subprocess.Popen:
    """The compiler, started on `source` for Sapphire Rapids, writing its assembly to `out`."""
    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_path("include"))]
    command = [COMPILER, "-std=c++20", "-O0", "-march=sapphirerapids", "-fopenmp", "-fPIC", *flags,
               "-DTORCH_EXTENSION_NAME=amx_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
               "-S", str(Path(ops.__file__).with_name(source)), "-o", str(out)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_amx_code_compiles_for_sapphire_rapids(tmp_path):
    probe = subprocess.run([COMPILER, "-march=sapphirerapids", "-x", "c++", "-E", "-dM", "/dev/null"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{COMPILER} does not know -march=sapphirerapids")
    assert "__AMX_TILE__" in probe.stdout and "__AMX_BF16__" in probe.stdout
    for source, flags in SOURCES.items():   # one at a time: two at once ran 2x slower on 2 cores
        assembly = tmp_path / f"{source}.s"
        build = _compiles_for_sapphire_rapids(source, flags, assembly)
        log, _ = build.communicate(timeout=600)
        assert build.returncode == 0, f"{source} does not compile for AMX:\n{log[-4000:]}"
        text = assembly.read_text()
        missing = [name for name in AMX_INSTRUCTIONS if name not in text]
        assert not missing, f"{source} built for AMX has no {', '.join(missing)}: is its AMX code compiled?"
