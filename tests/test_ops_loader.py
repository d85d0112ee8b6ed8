"""The kernel loader survives what a killed build leaves behind and never waits forever."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestrel import ops
from kestrel.ops import _build_key, cpu_kernels, cpu_kernels_isa, cpu_kernels_source, extension_build_dir

pytestmark = pytest.mark.skipif(cpu_kernels_source() is None or cpu_kernels() is None,
                                reason="needs the compiled CPU kernels (AVX-512 or AVX2, and a compiler)")

LOAD = ("import logging, sys; logging.basicConfig(); from kestrel.ops import cpu_kernels; "
        "sys.exit(0 if cpu_kernels() is not None else 3)")


def _build_dir() -> Path:
    return extension_build_dir("cpu_kernels.cpp", cpu_kernels_isa())


def test_a_stale_torch_lock_from_a_killed_build_does_not_block_loading():
    stale = _build_dir() / "lock"
    stale.touch()
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", LOAD], timeout=120)
    assert done.returncode == 0
    assert time.monotonic() - start < 60
    assert not stale.exists()


def test_a_build_held_too_long_falls_back_with_a_warning():
    with open(_build_dir() / "kestrel.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = dict(os.environ, KESTREL_KERNEL_BUILD_WAIT_S="1")
        done = subprocess.run([sys.executable, "-c", LOAD], env=env, timeout=60,
                              capture_output=True, text=True)
    assert done.returncode == 3
    assert "building" in done.stderr and "PyTorch path" in done.stderr


def test_the_build_key_follows_the_source(tmp_path):
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    a.write_text("int f() { return 1; }")
    b.write_text("int f() { return 2; }")
    assert _build_key(a) != _build_key(b)
    assert _build_key(a) == _build_key(a)
    before = _build_key(a)
    (tmp_path / "shared.h").write_text("#pragma once")       # a header beside the source counts too
    assert _build_key(a) != before


def test_two_torch_installs_of_one_version_build_apart(tmp_path, monkeypatch):
    # build.ninja names torch's headers and libraries: one shared build directory would make two
    # virtual environments rebuild each other's module on every load.
    import torch
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }")
    here = _build_key(source)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert _build_key(source) != here


def test_the_build_compiles_its_own_copy_of_the_source():
    # build.ninja names no checkout's path, so two checkouts of one version share a build without
    # rebuilding each other's module (torch rebuilds whenever build.ninja changes).
    ninja = (_build_dir() / "build.ninja").read_text()
    assert str(Path(ops.__file__).parent) not in ninja
    assert f"compile {_build_dir() / 'cpu_kernels.cpp'}" in ninja
