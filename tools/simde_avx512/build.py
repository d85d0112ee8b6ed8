"""Builds the AVX-512 extension of kestrel/ops (every source of kestrel/ops/build.py's SOURCES with
KESTREL_VEC_AVX512) for the AVX-512 CPU that KESTREL_SIMDE_CPU names (cpus.py; never AMX), onto
SIMDe, for an AVX2 machine to run, and prints the module's path. Usage: build.py [BUILD_DIR].

SIMDe's functions are kept out of line (SIMDE_NO_INLINE): inlined, GCC had not finished
the kernels after 30 minutes; out of line it takes about 3. Two edits to the staged copy only:
the inline-asm register pins ("+v", a zmm register) become memory operands, and the int8 kernel's
`vpdpbusd` asm its intrinsic.
"""

import sys
from pathlib import Path

from torch.utils.cpp_extension import load

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from aliases import header  # noqa: E402
from cpus import MACROS, selected  # noqa: E402

CSRC = HERE.parent.parent / "kestrel" / "ops" / "csrc"
EDITS = (('asm("" : "+v"(', 'asm("" : "+m"('),
         ('asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w.biased), "v"(x));',
          "acc = _mm512_dpbusd_epi32(acc, w.biased, x);"))
FLAGS = ["-O2", "-march=x86-64-v3", "-mtune=native", "-fopenmp", "-w", "-DKESTREL_VEC_AVX512",
         "-DSIMDE_NO_INLINE", "-include", "kestrel_simde_avx512.h"]


def sources() -> list[str]:
    """The extension's sources, in kestrel/ops/build.py's order (read from it: this runs without kestrel)."""
    text = (CSRC.parent / "build.py").read_text()
    listed = text[text.index("SOURCES = ("):text.index(")", text.index("SOURCES = ("))]
    return [line.strip().strip('",') for line in listed.splitlines()[1:] if line.strip().endswith('.cpp",')]


def stage(build_dir: Path, cpu: str) -> None:
    """The sources, edited, written only where they changed (a new mtime would make ninja rebuild)."""
    files = {p.name: p.read_text() for p in (*CSRC.iterdir(), HERE / "own_intrinsics.h")}
    for name in files:
        for old, new in EDITS:
            files[name] = files[name].replace(old, new)
        if '"v"(' in files[name] or '"+v"(' in files[name]:  # a zmm operand EDITS does not know yet
            raise SystemExit(f"{name}: inline asm on a zmm register; add its emulated form to EDITS")
    files["kestrel_simde_avx512.h"] = header(MACROS[cpu])
    for name, text in files.items():
        path = build_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def main() -> None:
    cpu = selected()
    build_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/kestrel/simde_avx512" / cpu
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").unlink(missing_ok=True)  # torch's lock file, left behind by a killed build
    stage(build_dir, cpu)
    flags = [f if f != "kestrel_simde_avx512.h" else str(build_dir / f) for f in FLAGS]
    module = load(name=f"kestrel_kernels_simde_{cpu}", sources=[str(build_dir / source) for source in sources()],
                  build_directory=str(build_dir), extra_cflags=flags, extra_ldflags=["-fopenmp"])
    print(module.__file__)


if __name__ == "__main__":
    main()
