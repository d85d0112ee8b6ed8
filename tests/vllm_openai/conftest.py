"""vLLM's OpenAI-entrypoint tests (tests/entrypoints/openai), ported to run against `kestrel serve`.

What changed from vLLM's files is marked `# kestrel:` in each; the cases dropped are listed at the top
of each file. Async tests are vLLM's pytest-asyncio tests run by anyio's pytest plugin (installed with
anyio): each module is marked `anyio` (on asyncio), its async fixtures written with `pytest.fixture`;
vLLM's `asyncio` marks stay, and mean nothing here.
"""

from __future__ import annotations

import os
import sys

import pytest

# tests/ (server_process, parity) on the path, as for the tests beside it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "asyncio: a vLLM (pytest-asyncio) test, run here by anyio's plugin")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
