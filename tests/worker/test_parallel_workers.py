"""Several workers under one engine core (issue 18): tensor and pipeline parallel ranks as processes
(the mp executor) and as Ray actors, against transformers on the same weights.

Each engine runs its prompts twice: the first pass with chunked prefill (a small token budget) and
forced preemption (few KV blocks), the second with prefix-cache hits on every prompt; both passes
must keep DESIGN.md's parity rule. Float32 throughout; the all-reduce sums in another order than one
matmul does, so the top-5 rule applies, and most sequences must still match exactly.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.exceptions import EngineDeadError
from kestrel.worker.multiproc_executor import WorkerFailed
from tests.support.parity import TOP, Greedy, assert_greedy_close, hf_greedy, save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 16
VOCAB = 49152


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3Config
    common = dict(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "llama-4h-2kv":      # heads and KV heads divide by 2
        return LlamaConfig(**common, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=True)
    if kind == "llama-4h-1kv":      # one KV head: replicated on both ranks
        return LlamaConfig(**common, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                           tie_word_embeddings=False)
    if kind == "qwen3-6h-3kv":      # three KV groups over two ranks: 2 and 1
        return Qwen3Config(**common, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                           tie_word_embeddings=False)
    raise ValueError(kind)


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 5, 17, 40, 77, 130][:n]
    return [[rng.randrange(100, VOCAB) for _ in range(length)] for length in lengths]


def _tiny(kind: str, folder):
    """The random-weight model saved to `folder` (the default model's tokenizer beside it), its prompts
    and transformers' greedy continuations of them."""
    model = save_tiny_model(folder, _config(kind))
    prompts = _prompts()
    return folder, prompts, hf_greedy(model, prompts, NEW_TOKENS)


# Fewer KV heads than ranks (replicated), and heads that split 2:1 around whole KV groups; the even
# split is what the default model and test_tp_model's tiny models run.
@pytest.fixture(scope="module", params=["llama-4h-1kv", "qwen3-6h-3kv"])
def tiny(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory.mktemp(request.param))


# Chunked prefill (32-token budget) and preemption (24 blocks of 16 for 6 prompts of up to 146 tokens).
STRESS = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=24)


def _greedy(llm: LLM, prompts) -> tuple[list[Greedy], int]:
    """Greedy continuations with top-5 logprobs, and how many prompt tokens came from the prefix cache."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runs = [Greedy(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in (o.outputs[0] for o in outs)]
    return runs, sum(o.num_cached_tokens for o in outs)


def _check_engine(llm: LLM, prompts, reference) -> None:
    first, _ = _greedy(llm, prompts)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0, "the first pass should have preempted"
    second, cached = _greedy(llm, prompts)
    assert cached > 0, "the second pass should have hit the prefix cache"
    for ours in (first, second):
        num_exact = assert_greedy_close(reference, ours, exact=False)
        assert num_exact >= len(prompts) - 1, num_exact


def raise_on_rank_1(worker) -> None:
    if worker.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")


def worker_cpu_binding(worker) -> tuple[list[int], int, int]:
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.getpid()


def test_tensor_parallel_2_on_processes_matches_transformers(tiny):
    folder, prompts, reference = tiny
    llm = LLM(model=str(folder), tensor_parallel_size=2, **STRESS)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert type(executor).__name__ == "MultiprocExecutor"
        bindings = executor.collective_rpc(worker_cpu_binding)
        # One process per rank, each pinned to its own share of the cores.
        assert len({pid for *_, pid in bindings}) == 2 and os.getpid() not in {pid for *_, pid in bindings}
        if len(os.sched_getaffinity(0)) >= 2:
            assert not set(bindings[0][0]) & set(bindings[1][0]), bindings
            assert all(threads == len(cores) for cores, threads, _ in bindings)
        published, answers = executor.stats.steps, executor.stats.step_answers
        _check_engine(llm, prompts, reference)
        steps = executor.stats.steps - published
        # Each step goes out once to both workers, and only the sampling rank answers it.
        assert steps > 0 and executor.stats.step_answers - answers == steps
        # A worker that raises fails the call, and the engine serves no more (nothing hangs).
        with pytest.raises(WorkerFailed, match="worker rank 1 raised"):
            executor.collective_rpc(raise_on_rank_1)
        with pytest.raises(EngineDeadError, match="worker rank 1 raised"):
            _greedy(llm, prompts[:1])
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_pipeline_parallel_2_matches_transformers(tmp_path):
    folder, prompts, reference = _tiny("llama-4h-2kv", tmp_path)
    llm = LLM(model=str(folder), pipeline_parallel_size=2, **STRESS)
    try:
        core = llm.llm_engine.engine_core
        assert core.batch_queue_size == 2
        _check_engine(llm, prompts, reference)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tensor_and_pipeline_parallel_2x2_matches_transformers(tmp_path):
    folder, prompts, reference = _tiny("qwen3-6h-3kv", tmp_path)
    llm = LLM(model=str(folder), tensor_parallel_size=2, pipeline_parallel_size=2, **STRESS)
    try:
        _check_engine(llm, prompts, reference)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_tensor_parallel_2_on_ray_matches_transformers(tmp_path):
    ray = pytest.importorskip("ray", reason="needs the package ray")
    folder, prompts, reference = _tiny("qwen3-6h-3kv", tmp_path)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(model=str(folder), tensor_parallel_size=2, distributed_executor_backend="ray", **STRESS)
        try:
            assert type(llm.llm_engine.engine_core.executor).__name__ == "RayExecutor"
            _check_engine(llm, prompts, reference)
        finally:
            llm.llm_engine.engine_core.shutdown()
    finally:
        ray.shutdown()
