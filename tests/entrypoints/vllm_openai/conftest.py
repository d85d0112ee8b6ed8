"""vLLM's OpenAI-entrypoint tests (tests/entrypoints/openai), ported to run against `kestrel serve`.

What changed from vLLM's files is marked `# kestrel:` in each; the cases dropped are listed at the top
of each file. Async tests are vLLM's pytest-asyncio tests run by anyio's pytest plugin (installed with
anyio): each module is marked `anyio` (on asyncio), its async fixtures written with `pytest.fixture`;
vLLM's `asyncio` marks stay, and mean nothing here.
"""

from __future__ import annotations

import gc

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "asyncio: a vLLM (pytest-asyncio) test, run here by anyio's plugin")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="package", autouse=True)
def frozen_heap():
    """See `collect_unclosed_clients`: what survives each collection is frozen, so that the next one
    scans only what a test made since (a full collection of this process's heap takes ~0.8 s on two
    cores, after every one of ~70 tests). Once these tests end the heap is unfrozen and collected,
    still outside any loop (clients that module fixtures held were frozen with them)."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def collect_unclosed_clients(frozen_heap):
    """Some of vLLM's tests leave an `openai.AsyncOpenAI` unclosed. Its finalizer schedules the close on
    whatever event loop is running when the garbage collector gets to it: a later test's, which then
    fails on a connection of a closed loop ("Event loop is closed"). Collected here, after each test and
    outside any loop, the finalizer does nothing."""
    yield
    gc.collect()
    gc.freeze()


# vLLM's tests/entrypoints/conftest.py fixtures that the ported tests use.

@pytest.fixture
def sample_regex():
    return (
        r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
        r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
    )


@pytest.fixture
def sample_json_schema():
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 3,
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {"type": "string"},
                        "duration": {"type": "number"},
                        "position": {"type": "string"},
                    },
                    "required": ["company", "position"],
                },
            },
        },
        "required": ["name", "age", "skills", "work_history"],
    }


@pytest.fixture
def sample_structured_outputs_choices():
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]
