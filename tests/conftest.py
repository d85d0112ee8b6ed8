import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

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
