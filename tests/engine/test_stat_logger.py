"""The periodic engine stats line (kestrel/engine/stat_logger.py), as vLLM's LoggingStatLogger."""

from __future__ import annotations

import logging

import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.stat_logger import LoggingStatLogger
from kestrel.messages import SchedulerStats

LOGGER = "kestrel.engine.stat_logger"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(**kwargs) -> SchedulerStats:
    return SchedulerStats(**kwargs)


def test_the_line_from_known_stats(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        stat_logger.record(stats(num_prompt_tokens=800, prefix_cache_queries=100, prefix_cache_hits=40,
                                 num_running_reqs=1, kv_cache_usage=0.1))
        clock.now += 4.0
        stat_logger.record(stats(num_prompt_tokens=200, num_generation_tokens=20, num_running_reqs=3,
                                 num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=100))
        assert caplog.records == []  # not yet 10 s
        clock.now += 6.0
        stat_logger.record(stats(num_generation_tokens=30, num_running_reqs=3, num_waiting_reqs=2,
                                 kv_cache_usage=0.25))
    [record] = caplog.records
    # 1000 prompt and 50 generated tokens in 10 s; 40 hits of 200 lookups; the latest step's counts.
    assert record.getMessage() == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                                   "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
                                   "Prefix cache hit rate: 20.0%")
    # The next line counts from this one: 10 generated tokens in 2 s.
    clock.now += 2.0
    stat_logger.record(stats(num_generation_tokens=10, num_running_reqs=1))
    assert stat_logger.log().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s")


def test_an_idle_interval_logs_nothing(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        clock.now += 11.0
        stat_logger.record(stats())
    assert caplog.records == []


def test_a_pause_does_not_dilute_the_next_line(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(interval_s=10.0, clock=clock)
    stat_logger.record(stats(num_generation_tokens=10, num_running_reqs=1))
    clock.now += 1.0
    stat_logger.record(stats(num_generation_tokens=10))  # the last request finished: idle
    assert stat_logger.log().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0")
    clock.now += 1000.0  # an hour of nothing, then work again: 40 tokens in the 10 s after it resumed
    stat_logger.record(stats(num_generation_tokens=20, num_running_reqs=1))
    clock.now += 10.0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        stat_logger.record(stats(num_generation_tokens=20, num_running_reqs=1))
    [record] = caplog.records
    assert "Avg generation throughput: 4.0 tokens/s" in record.getMessage()


def test_disabled_it_is_silent(caplog):
    clock = Clock()
    stat_logger = LoggingStatLogger(enabled=False, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        stat_logger.record(stats(num_prompt_tokens=5, num_running_reqs=1))
        clock.now += 60.0
        stat_logger.record(stats(num_generation_tokens=5, num_running_reqs=1))
        assert stat_logger.log() is None
    assert caplog.records == []


@pytest.fixture(scope="module")
def logging_llm():
    return LLM(max_model_len=128, kv_cache_memory=32 << 20, disable_log_stats=False)


def test_it_logs_during_a_run(logging_llm, caplog):
    logging_llm.llm_engine.stat_logger.interval_s = 0.0  # a line at every step
    with caplog.at_level(logging.INFO, logger=LOGGER):
        logging_llm.generate(["Once upon a time"] * 2, SamplingParams(max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines and all(line.startswith("Avg prompt throughput: ") for line in lines)
    assert any("Running: 2 reqs" in line for line in lines)


def test_offline_llm_logs_no_stats_by_default(logging_llm, caplog):
    llm = LLM(max_model_len=128, kv_cache_memory=32 << 20)
    assert llm.llm_engine.config.disable_log_stats and not llm.llm_engine.stat_logger.enabled
    assert logging_llm.llm_engine.config.disable_log_stats is False
    llm.llm_engine.stat_logger.interval_s = 0.0
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llm.generate("Once upon a time", SamplingParams(max_tokens=2), use_tqdm=False)
    assert [r for r in caplog.records if r.name == LOGGER] == []


@pytest.mark.slow
def test_the_server_front_end_logs_while_it_works(caplog):
    import asyncio

    from kestrel.engine.arg_utils import EngineArgs
    from kestrel.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(EngineArgs(max_model_len=128, kv_cache_memory=32 << 20))
    try:
        (stat_logger,) = engine.stat_loggers  # one engine core, one logger
        assert stat_logger.enabled  # the server logs stats unless --disable-log-stats
        stat_logger.interval_s = 0.0

        async def run() -> None:
            async for _ in engine.generate("Once upon a time", SamplingParams(max_tokens=4, ignore_eos=True)):
                pass

        with caplog.at_level(logging.INFO, logger=LOGGER):
            asyncio.run(run())
    finally:
        engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("Avg generation throughput: " in line and "Running: 1 reqs" in line for line in lines), lines


def test_the_stats_line_reports_acceptance():
    from kestrel.engine.stat_logger import LoggingStatLogger
    from kestrel.messages import SchedulerStats, SpecDecodingStats
    now = [0.0]
    logger = LoggingStatLogger(interval_s=10.0, clock=lambda: now[0])
    for _ in range(2):
        logger.record(SchedulerStats(num_running_reqs=1, num_generation_tokens=5, spec_decoding=SpecDecodingStats(
            num_drafts=2, num_draft_tokens=8, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0, 0])))
    now[0] = 10.0
    line = logger.log()
    assert "Spec decode: mean acceptance length 2.50, accepted 6/16 draft tokens (37.5%), " \
           "per position: 1.000, 0.500, 0.000, 0.000" in line
    now[0] = 20.0
    logger.record(SchedulerStats(num_running_reqs=1, num_generation_tokens=5))
    assert "Spec decode" not in logger.log()  # counted per line
