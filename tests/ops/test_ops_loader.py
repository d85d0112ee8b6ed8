"""The kernel loader survives what a killed build leaves behind and never waits forever."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel.ops import build, cpu_kernels, cpu_kernels_isa
from tests.support.skips import needs_cpu

pytestmark = pytest.mark.skipif(cpu_kernels_isa() is None or cpu_kernels() is None, reason=needs_cpu("AVX2"))

LOAD = ("import logging, sys; logging.basicConfig(); from kestrel.ops import cpu_kernels; "
        "sys.exit(0 if cpu_kernels() is not None else 3)")


def _build_dir() -> Path:
    return build.build_dir(cpu_kernels_isa())


def test_a_stale_torch_lock_from_a_killed_build_does_not_block_loading():
    stale = _build_dir() / "lock"
    stale.touch()
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LOAD], timeout=120)
    assert done.returncode == 0
    assert time.monotonic() - start < 60
    assert not stale.exists()


def test_a_build_held_too_long_falls_back_with_a_warning():
    """A user's engine: a warning and the PyTorch path; the tests' strict mode: the error itself."""
    with open(_build_dir() / "kestrel.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = dict(os.environ, KESTREL_KERNEL_BUILD_WAIT_S="1")
        done = subprocess.run([sys.executable, "-c", LOAD], env=dict(env, KESTREL_STRICT_KERNELS="0"), timeout=60,
                              capture_output=True, text=True)
        strict = subprocess.run([sys.executable, "-c", LOAD], env=dict(env, KESTREL_STRICT_KERNELS="1"), timeout=60,
                                capture_output=True, text=True)
    assert done.returncode == 3
    assert "building" in done.stderr and "PyTorch path" in done.stderr
    assert strict.returncode == 1 and "TimeoutError" in strict.stderr


def test_two_torch_installs_of_one_version_build_apart(tmp_path, monkeypatch):
    # build.ninja names torch's headers and libraries: one shared build directory would make two
    # virtual environments rebuild each other's module on every load.
    import torch
    here = build.build_key("avx2")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert build.build_key("avx2") != here


def test_a_failed_build_raises_the_compilers_message_when_strict(tmp_path):
    """KESTREL_STRICT_KERNELS=1 (the tests): a kernel that does not compile is an error naming the
    compiler's complaint; without it, a warning and the PyTorch path."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for path in build.CSRC.iterdir():
        (csrc / path.name).write_bytes(path.read_bytes())
    with open(csrc / "elementwise.cpp", "a") as source:
        source.write("\nthis_is_not_cpp;\n")
    script = ("import sys; from pathlib import Path; from kestrel.ops import build; "
              f"build.CSRC = Path({str(csrc)!r}); import kestrel.ops as ops; "
              "sys.exit(0 if ops.cpu_kernels() is None else 3)")
    env = dict(os.environ, KESTREL_KERNEL_CACHE=str(tmp_path / "cache"), KESTREL_CPU_KERNELS="avx2")
    strict = subprocess.run([sys.executable, "-c", script], env=dict(env, KESTREL_STRICT_KERNELS="1"),
                            capture_output=True, text=True, timeout=600)
    assert strict.returncode not in (0, 3)
    assert "KernelBuildError" in strict.stderr and "this_is_not_cpp" in strict.stderr
    lenient = subprocess.run([sys.executable, "-c", script], env=dict(env, KESTREL_STRICT_KERNELS="0"),
                             capture_output=True, text=True, timeout=600)
    assert lenient.returncode == 0 and "PyTorch path" in lenient.stderr


def test_the_build_compiles_its_own_copy_of_the_source():
    # build.ninja names no checkout's path, so two checkouts of one version share a build without
    # rebuilding each other's module (torch rebuilds whenever build.ninja changes).
    ninja = (_build_dir() / "build.ninja").read_text()
    assert str(build.CSRC) not in ninja
    for source in build.SOURCES:
        assert f"{_build_dir() / source}" in ninja
