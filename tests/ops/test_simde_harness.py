"""tools/simde_avx512, the AVX-512 builds of the kernels emulated on an AVX2 machine, still builds: every
AVX-512 intrinsic the kernels call has an emulated form, and every inline-asm zmm operand an edit.
Its build takes minutes and its run more (its README), so it is run by hand; this takes a second, so
that a kernel change that would break it fails here instead (a non-temporal 512-bit load broke it on
2026-12-06, unnoticed for 15 hours)."""

import re
import sys
from pathlib import Path

import pytest

from kestrel.ops import build as kernel_build

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tools" / "simde_avx512"
OPS = ROOT / "kestrel" / "ops"
sys.path.insert(0, str(HARNESS))
import aliases  # noqa: E402
import build  # noqa: E402
import cpus  # noqa: E402

sys.path.remove(str(HARNESS))

pytestmark = pytest.mark.skipif(not Path("/usr/include/simde/x86/avx512.h").exists(),
                                reason="needs Debian's libsimde-dev")   # `make test` installs it where it runs as root


def test_every_avx512_intrinsic_the_kernels_call_is_emulated():
    used: set[str] = set()
    for source in (*OPS.rglob("*.cpp"), *OPS.rglob("*.h")):
        used |= set(re.findall(rf"\b_{aliases.NAME}\b", source.read_text()))
    assert "mm512_loadu_si512" in used  # the pattern finds them
    missing = used - aliases.simde_names() - aliases.own_names()
    assert not missing, f"add these to tools/simde_avx512/own_intrinsics.h (as Intel's manual defines them): {missing}"


@pytest.mark.parametrize("cpu", sorted(cpus.MACROS))
def test_each_cpu_stages_its_sources(cpu, tmp_path):
    """Staging edits the inline asm on zmm registers into forms SIMDe compiles (and exits where it
    meets one it does not know), and writes the header with the CPU's feature macros."""
    build.stage(tmp_path, cpu)
    assert build.sources() == list(kernel_build.SOURCES)
    for source in build.sources():
        staged = (tmp_path / source).read_text()
        assert '"+v"(' not in staged and '"v"(' not in staged
    header = (tmp_path / "kestrel_simde_avx512.h").read_text()
    defined = set(re.findall(r"#define __(AVX512[A-Z0-9]*)__ 1", header))
    assert defined == set(cpus.MACROS[cpu])
