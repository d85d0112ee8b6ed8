"""Settings and hooks for the whole suite, loaded by `pytest` at the root and by `pytest tests/<box>` alike.

tests/ is a package (tests/__init__.py, and one per box), so test modules import as `tests.<box>.test_x` and
share helpers as `from tests.support.parity import ...`, whatever folder pytest was given."""

import os
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# A kernel that this CPU supports but that fails to build raises (with the compiler's message) instead of
# falling back to PyTorch, so that the tests of it fail rather than skip. Tests of the fallback itself set
# KESTREL_DISABLE_CPU_KERNELS=1, which this does not touch.
os.environ.setdefault("KESTREL_STRICT_KERNELS", "1")

import pytest  # noqa: E402


def assert_engine_idle_and_consistent(llm) -> None:
    """The pool invariant after an engine test: no request left, every block back in the pool,
    and free + in-use == total."""
    core = llm.llm_engine.engine_core
    core.check_invariants()
    assert not core.has_unfinished_requests()
    assert not llm.llm_engine.has_unfinished_requests()
    pool = core.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks still held after every request ended"


@pytest.fixture
def engine_check():
    return assert_engine_idle_and_consistent


def pytest_terminal_summary(terminalreporter) -> None:
    """One line at the end: the skipped tests counted by reason (tests/support/skips.py names each)."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_line("skips by reason: " + "; ".join(f"{n} {r}" for r, n in reasons.most_common()))
