"""Data parallel (`--data-parallel-size D`, `-dp D`): D engine-core processes behind one front end.

Fast: the routing choice (router.py), the merged stats, the CPU slices, the flag, the per-engine
metrics. Slow: a `-dp 2` server on a tiny random float32 Llama (greedy parity with transformers under
chunked prefill, prefix hits and preemption; both cores busy; aborts reaching the owning core; a
killed core ends every request and the server), and the offline `LLM(data_parallel_size=2)`.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx2 as httpx
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ParallelConfig
from kestrel.distributed.cpu_binding import cpu_slice, engine_core_cpu_slice
from kestrel.engine.arg_utils import EngineArgs, create_engine_config, engine_kwargs
from kestrel.engine.core_client import merge_gauges, merge_step_stats
from kestrel.engine.router import LeastLoadedRouter
from kestrel.engine.stat_logger import LoggingStatLogger
from kestrel.entrypoints.cli import build_parser
from kestrel.entrypoints.openai.metrics import ServerMetrics
from kestrel.messages import SchedulerStats
from tests.support.parity import (
    TOP,
    Greedy,
    assert_greedy_close,
    hf_greedy,
    kestrel_greedy,
    save_tiny_llama,
    save_tiny_model,
)
from tests.support.server_process import Server, assert_error

NEW_TOKENS = 24
VOCAB = 49152


# ---- routing (pure python) ------------------------------------------------------------------------

def test_a_burst_between_reports_spreads_over_the_cores():
    router = LeastLoadedRouter(2)
    assert [router.assign([f"r{i}"]) for i in range(6)] == [0, 1, 0, 1, 0, 1]


def test_the_core_with_the_fewest_waiting_then_running_gets_the_request():
    router = LeastLoadedRouter(3)
    router.record_stats(0, SchedulerStats(num_waiting_reqs=2, num_running_reqs=0))
    router.record_stats(1, SchedulerStats(num_waiting_reqs=0, num_running_reqs=7))
    router.record_stats(2, SchedulerStats(num_waiting_reqs=0, num_running_reqs=3))
    assert router.assign(["a"]) == 2   # nobody waits on 1 or 2; 2 runs fewer
    assert router.assign(["b"]) == 1   # 2 now has one sent since its report, counted as waiting
    assert router.assign(["c"]) == 2   # 1 and 2 have one waiting each; 2 runs fewer
    router.record_stats(2, SchedulerStats(num_waiting_reqs=0, num_running_reqs=5))  # its report replaces the estimate
    assert router.assign(["d"]) == 2


def test_the_samples_of_one_request_go_to_one_core_and_count_as_its_load():
    router = LeastLoadedRouter(2)
    children = ["0_req", "1_req", "2_req"]
    core = router.assign(children)
    assert {router.owner(c) for c in children} == {core}
    other = 1 - core
    assert router.assign(["x"]) == other and router.assign(["y"]) == other  # 1, then 2 < 3 sent
    assert router.assign(["z"]) == other  # 2 < 3
    assert router.loads[core].sent_since_report == 3 and router.loads[other].sent_since_report == 3
    router.record_stats(other, SchedulerStats(num_waiting_reqs=1, num_running_reqs=2))
    assert router.assign(["w"]) == other  # its report: 1 waiting, fewer than the 3 sent to the first


def test_aborts_go_to_the_owner_until_the_request_ends():
    router = LeastLoadedRouter(2)
    first, second = router.assign(["0_a", "1_a"]), router.assign(["b"])
    assert first != second
    assert router.release(["1_a", "b", "unknown"]) == {first: ["1_a"], second: ["b"]}
    assert router.release(["b"]) == {}  # already ended: no core is told
    assert router.owner("0_a") == first and router.num_owned == 1
    with pytest.raises(ValueError):
        LeastLoadedRouter(0)


def test_merged_stats_sum_requests_and_average_kv_usage():
    latest = [SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5),
              SchedulerStats(num_running_reqs=3, num_waiting_reqs=0, kv_cache_usage=0.25)]
    merged = merge_gauges(latest)
    assert (merged.num_running_reqs, merged.num_waiting_reqs, merged.kv_cache_usage) == (5, 1, 0.375)
    assert merge_gauges([None, None]) is None
    assert merge_gauges([None, latest[0]]).kv_cache_usage == 0.25  # a core not heard from holds nothing
    step = merge_step_stats(latest, [SchedulerStats(num_generation_tokens=4, prefix_cache_hits=16),
                                     SchedulerStats(num_generation_tokens=3, num_preemptions=1)])
    assert (step.num_generation_tokens, step.prefix_cache_hits, step.num_preemptions, step.num_running_reqs) == (
        7, 16, 1, 5)


# ---- configuration --------------------------------------------------------------------------------

def test_engine_cores_split_the_cpu_cores_only_when_there_are_several():
    assert engine_core_cpu_slice(ParallelConfig()) is None
    for rank in range(2):
        parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        assert engine_core_cpu_slice(parallel) == cpu_slice(rank, 2)
    assert cpu_slice(0, 2, [0, 1, 2, 3, 4]).cores == (0, 1, 2) and cpu_slice(1, 2, [0, 1, 2, 3, 4]).cores == (3, 4)


def test_the_dp_flag_reaches_the_config_and_is_accepted():
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "-dp", "2"]))
    assert kwargs == {"data_parallel_size": 2}
    config, _, _ = create_engine_config(EngineArgs(**kwargs))  # reads the model's config, loads no weights
    assert config.parallel.data_parallel_size == 2 and config.parallel.data_parallel_rank == 0
    assert config.parallel.num_local_workers == 2


def test_the_stats_line_names_its_engine():
    line = LoggingStatLogger(label="Engine 1").format_line(1.0)
    assert line.startswith("Engine 1: Avg prompt throughput: 0.0 tokens/s")
    assert LoggingStatLogger().format_line(1.0).startswith("Avg prompt throughput")


class FakeEngine:
    core_stats = [SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5), None]
    core_counters = [{"generation_tokens": 7}, {"generation_tokens": 5, "prompt_tokens": 3}]


def test_metrics_carry_one_series_per_engine():
    text = ServerMetrics(FakeEngine(), "m").render().decode()
    assert 'kestrel:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'kestrel:num_requests_running{engine="1",model_name="m"} 0.0' in text
    assert 'kestrel:kv_cache_usage_perc{engine="0",model_name="m"} 0.5' in text
    assert 'kestrel:generation_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'kestrel:generation_tokens_total{engine="1",model_name="m"} 5.0' in text
    assert 'kestrel:prompt_tokens_total{engine="1",model_name="m"} 3.0' in text


# ---- a -dp 2 server -------------------------------------------------------------------------------

def per_engine(server: Server) -> dict[str, dict[str, float]]:
    """/metrics: metric name -> {engine: value} for the series with an engine label."""
    values: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        m = re.match(r'^kestrel:([a-z_]+)\{[^}]*engine="(\d+)"[^}]*\} ([-+0-9.eE]+)$', line)
        if m:
            values.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return values


def engine_core_processes(server: Server) -> list:
    import psutil
    return [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 16, 17, 40, 77, 150]
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in lengths]


def prefix_prompts(seed: int, num: int) -> list[list[int]]:
    """Prompts that share their first 70 tokens (four full blocks of 16)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, VOCAB) for _ in range(70)]
    return [prefix + [rng.randrange(100, VOCAB) for _ in range(3 + 4 * i)] for i in range(num)]


async def greedy_completion(client: httpx.AsyncClient, url: str, prompt: list[int]) -> Greedy:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": TOP}
    r = await client.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == NEW_TOKENS
    return Greedy(lp["tokens"], lp["top_logprobs"])


def as_text(tokenizer, ref: Greedy) -> Greedy:
    """A transformers run in the server's terms: each token as its text, as /v1/completions names it."""
    def text(t: int) -> str:
        return tokenizer.decode([t])
    return Greedy([text(t) for t in ref.token_ids], [{text(t): v for t, v in step.items()} for step in ref.top])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-dp")
    return folder, save_tiny_llama(folder)


@pytest.fixture(scope="module")
def dp_server(tiny):
    folder, _ = tiny
    # Per core: a 20-token step budget splits every long prompt (chunked prefill); 17 blocks of 16 barely
    # hold one 256-token sequence (preemption); prefix caching is on.
    server = Server("--model", str(folder), "--dtype", "float32", "--max-model-len", "256", "-dp", "2",
                    "--max-num-batched-tokens", "20", "--num-kv-blocks", "17", held=True)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_engine_cores_match_transformers_and_share_the_work(tiny, dp_server):
    from kestrel.model.loader import load_tokenizer, resolve_model
    _, model = tiny
    tokenizer = load_tokenizer(resolve_model(None))  # the tiny model's, saved beside it
    warm, shared = prefix_prompts(1, 4)[:2], prefix_prompts(1, 4)[2:]
    batch = shared + random_prompts(0)  # the shared-prefix prompts first: scheduled before eviction
    reference = [as_text(tokenizer, g) for g in hf_greedy(model, warm + batch, NEW_TOKENS)]

    async def run() -> list[Greedy]:
        async with httpx.AsyncClient(timeout=300) as client:
            # Both cores see the shared prefix first (two at once go to different cores) ...
            first = await asyncio.gather(*[greedy_completion(client, dp_server.url, p) for p in warm])
            # ... then a burst, which spreads over both, hits the cached prefix and preempts.
            rest = await asyncio.gather(*[greedy_completion(client, dp_server.url, p) for p in batch])
            return [*first, *rest]

    ours = asyncio.run(run())
    assert assert_greedy_close(reference, ours, exact=False) >= len(reference) - 2
    metrics = per_engine(dp_server)
    assert set(metrics["generation_tokens_total"]) == {"0", "1"}
    # Besides its warm-up request, each core ran some of the burst.
    assert all(v > NEW_TOKENS for v in metrics["generation_tokens_total"].values()), metrics
    assert sum(metrics["generation_tokens_total"].values()) == len(reference) * NEW_TOKENS
    assert sum(metrics["prefix_cache_hits_total"].values()) >= 64, metrics
    assert sum(metrics["num_preemptions_total"].values()) > 0, metrics
    # Each engine core pinned itself to its own slice of this machine's cores, and the log says which.
    import psutil
    cores = engine_core_processes(dp_server)
    assert len(cores) == 2
    allowed = sorted(psutil.Process().cpu_affinity())
    assert sorted(tuple(p.cpu_affinity()) for p in cores) == sorted(cpu_slice(i, 2, allowed).cores for i in range(2))
    assert "engine core 1 of 2: cores" in dp_server.output()


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """Room for requests long enough to still run when a test acts on them (the tiny model again, with
    4096 positions); its last test kills a core."""
    from transformers import LlamaConfig
    folder = tmp_path_factory.mktemp("tiny-llama-4k")
    save_tiny_model(folder, LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True))
    server = Server("--model", str(folder), "--dtype", "float32", "--max-model-len", "4096", "-dp", "2",
                    "--kv-cache-memory", "64MiB", held=True)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert server.proc.returncode == server.expected_returncode, server.output()


LONG_STREAM = {"prompt": [500, 600, 700], "max_tokens": 4000, "ignore_eos": True, "stream": True}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_disconnect_aborts_the_request_in_the_core_that_owns_it(long_server):
    server = long_server

    async def stream_until_first_token(client: httpx.AsyncClient, started: asyncio.Event, done: asyncio.Event):
        async with client.stream("POST", f"{server.url}/v1/completions", json=LONG_STREAM) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # held: a dropped line iterator would close the connection now
            async for line in lines:
                if line.startswith("data: "):
                    break
            started.set()
            await done.wait()  # leaving the block closes the connection mid-stream

    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            started, done = [asyncio.Event(), asyncio.Event()], asyncio.Event()
            tasks = [asyncio.create_task(stream_until_first_token(client, s, done)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            server.hold()  # no step runs from here: only an abort can free the blocks
            await asyncio.sleep(0.5)
            busy = per_engine(server)
            done.set()
            await asyncio.gather(*tasks)
            deadline = time.monotonic() + 10
            while True:
                idle = per_engine(server)
                if time.monotonic() > deadline or all(v == 0 for v in idle["kv_cache_usage_perc"].values()):
                    return busy, idle
                await asyncio.sleep(0.1)

    try:
        busy, idle = asyncio.run(run())
    finally:
        server.release()
    # One stream on each core, both mid-generation when the clients went away ...
    assert busy["num_requests_running"] == {"0": 1.0, "1": 1.0}, busy
    assert all(v > 0 for v in busy["kv_cache_usage_perc"].values()), busy
    # ... and each core dropped its own request: every block is back, though no step ran.
    assert idle["num_requests_running"] == {"0": 0.0, "1": 0.0}, idle
    assert idle["kv_cache_usage_perc"] == {"0": 0.0, "1": 0.0}, idle


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_engine_core_ends_every_request_and_the_server(long_server):
    server = long_server

    async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
        events = []
        async with client.stream("POST", f"{server.url}/v1/completions", json=LONG_STREAM) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    started.set()
        return events

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = asyncio.gather(*[stream(client, s) for s in started])
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            server.hold()  # both requests stay in flight, one on each core
            await asyncio.sleep(0.3)
            assert per_engine(server)["num_requests_running"] == {"0": 1.0, "1": 1.0}
            server.expected_returncode = 1
            engine_core_processes(server)[1].kill()
            return await asyncio.wait_for(tasks, 15)

    try:
        streams = asyncio.run(run())
        # Both streams, the killed core's and the survivor's, end with an error event, then [DONE].
        for events in streams:
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 500 and "engine core" in error["message"] and "died" in error["message"], error
        assert_error(httpx.get(f"{server.url}/health"), 503, "ServiceUnavailableError", "died")
        assert server.proc.wait(timeout=30) == 1, server.output()
    finally:
        server.release()


# ---- the offline LLM ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_two_engine_cores_give_the_tokens_of_one(tiny):
    folder, _ = tiny
    prompts = random_prompts(2) + prefix_prompts(3, 3)
    kw = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=24)
    one = LLM(str(folder), **kw)
    expected = kestrel_greedy(one, prompts, NEW_TOKENS)
    one.llm_engine.shutdown()
    two = LLM(str(folder), data_parallel_size=2, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
        outs = two.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == prompts  # in the order of the prompts
        got = [Greedy(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
               for o in outs]
        assert assert_greedy_close(expected, got, exact=True) == len(prompts)
        router = two.llm_engine.engine_core.processes.router
        assert all(load.assigned_total > 0 for load in router.loads)  # both cores ran some
        assert not two.llm_engine.has_unfinished_requests() and router.num_owned == 0
        processes = [c.process for c in two.llm_engine.engine_core.processes.cores]
    finally:
        two.llm_engine.shutdown()
    assert not any(p.is_alive() for p in processes)
