"""The engine core in its own process, driven by the asynchronous front end (AsyncLLM)."""

import asyncio
import os
import signal
import time

import psutil
import pytest

from kestrel import SamplingParams
from kestrel.engine import async_llm
from kestrel.engine.arg_utils import EngineArgs
from kestrel.engine.async_llm import AsyncLLM, EngineDeadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


async def collect(llm, prompt, params, request_id, stream=True):
    text, token_ids, finish = "", [], None
    async for out in llm.generate(prompt, params, request_id, stream=stream):
        for c in out.outputs:
            if stream:
                text, token_ids = text + c.text, token_ids + c.token_ids
            else:
                text, token_ids = c.text, c.token_ids
            finish = c.finish_reason or finish
    return text, token_ids, finish


@pytest.fixture
def llm():
    engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory=64 << 20))
    yield engine
    engine.shutdown()


def test_concurrent_streams_equal_requests_alone(llm):
    prompts = [f"Story {i}: once upon a time there was" for i in range(8)]

    async def run():
        alone = [await collect(llm, p, GREEDY, f"alone-{i}") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*[collect(llm, p, GREEDY, f"batch-{i}") for i, p in enumerate(prompts)])
        final = await collect(llm, prompts[0], GREEDY, "final", stream=False)
        return alone, together, final

    alone, together, final = asyncio.run(run())
    assert [a[1] for a in alone] == [t[1] for t in together]
    assert all(t[2] == "length" and len(t[1]) == 16 for t in together)
    assert final == alone[0]  # one final output equals the concatenated stream
    assert llm.counters["generation_tokens"] >= 16 * 17
    assert llm.last_scheduler_stats.num_running_reqs == 0


def test_cancelled_stream_aborts_and_frees_blocks(llm):
    async def run():
        task = asyncio.create_task(collect(llm, "Count slowly:", SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True), "long"))
        while llm.counters["generation_tokens"] < 3:
            await asyncio.sleep(0.05)
        task.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            s = llm.last_scheduler_stats
            if s is not None and s.num_running_reqs == 0 and s.kv_cache_usage == 0.0:
                return s
        return llm.last_scheduler_stats

    stats = asyncio.run(run())
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
    assert llm.counters["generation_tokens"] < 200


def test_bad_input_raises_and_engine_keeps_serving(llm):
    async def run():
        with pytest.raises(ValueError, match="top_p"):
            await collect(llm, "Hi", SamplingParams(top_p=2.0), "bad")
        return await collect(llm, "Hi", GREEDY, "good")

    assert len(asyncio.run(run())[1]) == 16


def test_engine_core_death_ends_streams_with_an_error(llm):
    async def run():
        task = asyncio.create_task(collect(llm, "Count slowly:", SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True), "doomed"))
        while llm.counters["generation_tokens"] < 2:
            await asyncio.sleep(0.05)
        os.kill(llm.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await task
        return time.monotonic() - start

    assert asyncio.run(run()) < 5
    assert not llm.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(llm, "Hi", GREEDY, "after"))


def test_step_fault_ends_every_stream_with_its_message(monkeypatch):
    monkeypatch.setenv("KESTREL_TEST_FAULT_AT_STEP", "3")  # read by the engine core when it starts
    engine = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", max_model_len=256, kv_cache_memory=64 << 20))
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run():
        requests = [collect(engine, f"Story {i}:", long, f"doomed-{i}", stream=i % 2 == 0) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 60)
        return results, await asyncio.wait_for(engine.wait_until_errored(), 5)

    try:
        results, error = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert all("InjectedFault: injected fault at step 3" in str(r) for r in [*results, error])
        assert not engine.is_running and engine.error is error
        engine.process.join(timeout=30)
        assert engine.process.exitcode == 1
        with pytest.raises(EngineDeadError, match="not running: the engine core failed"):
            asyncio.run(collect(engine, "Hi", GREEDY, "after"))
    finally:
        engine.shutdown()


def test_an_unreadable_model_stops_the_engine_core_started_before_it_was_read(tmp_path, monkeypatch):
    """The engine core starts while the front end reads the model; when that fails, the loader's error
    reaches the caller and no process is left behind, nor its sockets' folder."""
    started = []
    prestart = async_llm.prestart_engine_cores
    monkeypatch.setattr(async_llm, "prestart_engine_cores", lambda size: started.extend(prestart(size)) or started)
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(ValueError, match="does-not-exist"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path / "does-not-exist")))
    assert [c for c in psutil.Process().children() if c.pid not in before and c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE and not is_resource_tracker(c)] == []
    assert len(started) == 1 and not os.path.exists(started[0].sock_dir)


def is_resource_tracker(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker: started by the first spawned process, it outlives them all."""
    return any("resource_tracker" in part for part in process.cmdline())


def test_shutdown_removes_the_sockets_folder(llm):
    folders = [core.sock_dir for core in llm.engine_cores.cores]
    assert all(os.path.isdir(folder) for folder in folders)
    llm.shutdown()
    assert not any(os.path.exists(folder) for folder in folders)


def test_a_bad_flag_fails_before_any_engine_core_starts(monkeypatch):
    def refuse(size):
        raise AssertionError("an engine core was started for a bad flag")
    monkeypatch.setattr(async_llm, "prestart_engine_cores", refuse)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        AsyncLLM.from_engine_args(EngineArgs(tensor_parallel_size=0))
