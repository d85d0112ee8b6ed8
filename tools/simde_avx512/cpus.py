"""The AVX-512 CPUs the harness stands in for (KESTREL_SIMDE_CPU picks one; zen4 by default): the
feature macros its builds define, the /proc/cpuinfo flags kestrel.ops then reads, and the sources
kestrel.ops builds for such a CPU (linear_bf16_avx512.cpp and the bf16 prefill attention need AVX512-BF16).

- zen4: AVX512-BF16 and AVX512-VNNI (AMD Zen 4 and 5; Intel Cooper Lake, and Sapphire Rapids less AMX).
- icelake: AVX512-VNNI without BF16 (Intel Cascade Lake, Ice Lake and its clients): the float32
  models and the GGUF tiles on vpdpwssd / vpdpbusd, without bf16 panels.
- skylake: neither (Intel Skylake-SP and -X): the 16-bit and byte products on vpmaddwd / vpmaddubsw,
  no int8 linear.

Usage: cpus.py   (the sources to build for the selected CPU, one a line; run.sh reads them)
"""

import os

_BASE = ("AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ", "AVX512CD")
MACROS = {
    "zen4": (*_BASE, "AVX512BF16", "AVX512VNNI"),
    "icelake": (*_BASE, "AVX512VNNI"),
    "skylake": _BASE,
}
# /proc/cpuinfo's name for each macro's feature.
_FLAG = {"AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512VL": "avx512vl", "AVX512DQ": "avx512dq",
         "AVX512CD": "avx512cd", "AVX512BF16": "avx512_bf16", "AVX512VNNI": "avx512_vnni"}


def selected() -> str:
    cpu = os.environ.get("KESTREL_SIMDE_CPU", "zen4")
    if cpu not in MACROS:
        raise SystemExit(f"KESTREL_SIMDE_CPU must be one of {', '.join(MACROS)}, not {cpu!r}")
    return cpu


def flags(cpu: str) -> frozenset[str]:
    return frozenset(_FLAG[m] for m in MACROS[cpu])


if __name__ == "__main__":
    print(selected())
