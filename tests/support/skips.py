"""Skip reasons that name what this machine lacks: one CPU feature, package or program each, so that the
summary's "skips by reason" line (tests/conftest.py) says what a machine would need to run them all.

A kernel that the CPU supports but that fails to build is no reason to skip: tests/conftest.py sets
KESTREL_STRICT_KERNELS=1, under which the product raises the compiler's message instead of falling back to
PyTorch, so such a test fails."""

from __future__ import annotations

import os


def needs_cpu(feature: str) -> str:
    """The reason to skip a test of a kernel that runs on CPUs with `feature` ("AVX2", "AVX512-BF16",
    "AMX-BF16", ...): that feature, or the switch that turned the kernels off here."""
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1":
        return "KESTREL_DISABLE_CPU_KERNELS=1 turns the compiled kernels off"
    if feature.startswith("AMX") and os.environ.get("KESTREL_DISABLE_AMX") == "1":
        return "KESTREL_DISABLE_AMX=1 turns the AMX kernels off"
    return f"needs a CPU with {feature}"
