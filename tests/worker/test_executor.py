"""The executor (kestrel/worker/executor.py): collective_rpc over every worker, the engine-facing
methods built on it, and the parallel settings, which accept only what is implemented."""

from __future__ import annotations

import types

import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import ParallelConfig
from kestrel.engine.arg_utils import EngineArgs, create_engine_config
from kestrel.entrypoints.cli import main
from kestrel.worker.executor import Executor, UniProcExecutor, call_worker
from kestrel.worker.select_executor import executor_class


class FakeWorker:
    def __init__(self, rank: int, num_blocks: int) -> None:
        self.rank = rank
        self.num_blocks = num_blocks
        self.kv_blocks: int | None = None

    def determine_num_kv_blocks(self) -> int:
        return self.num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_blocks = num_blocks

    def execute_model(self, scheduler_output) -> str:
        return f"rank {self.rank} ran {scheduler_output}"


class FakeExecutor(Executor):
    """Workers in a list, each with fewer KV blocks than the one before."""

    def _init_executor(self) -> None:
        self.workers = [FakeWorker(rank, 100 - 10 * rank) for rank in range(self.parallel_config.world_size)]

    def collective_rpc(self, method, args=(), kwargs=None):
        return [call_worker(w, method, args, kwargs) for w in self.workers]

    def shutdown(self) -> None:
        self.workers = []


def fake_executor(tp: int, pp: int) -> FakeExecutor:
    config = types.SimpleNamespace(parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    return FakeExecutor(config, source=None)


def test_engine_methods_are_built_on_collective_rpc():
    executor = fake_executor(tp=2, pp=2)
    assert executor.collective_rpc(lambda w, k: w.rank * k, (10,)) == [0, 10, 20, 30]
    assert executor.collective_rpc(lambda w, k=1: w.rank + k, kwargs={"k": 5}) == [5, 6, 7, 8]
    # Every worker must hold the pool: the smallest answer wins, and every worker gets it.
    assert executor.determine_num_kv_blocks() == 70
    executor.initialize_kv_cache(70)
    assert [w.kv_blocks for w in executor.workers] == [70] * 4
    # The last pipeline stage samples; its first tensor rank (2 of 0..3) answers the step.
    assert executor.output_rank == 2
    assert executor.execute_model("step 1") == "rank 2 ran step 1"
    assert fake_executor(tp=1, pp=1).output_rank == 0
    assert fake_executor(tp=4, pp=1).output_rank == 0
    assert fake_executor(tp=1, pp=3).output_rank == 2


def test_the_one_device_executor_is_the_default():
    assert executor_class(ParallelConfig()) is UniProcExecutor
    assert ParallelConfig().world_size == 1
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one worker, but"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs 2; use 'mp'"),
    ({"distributed_executor_backend": "nccl"}, "must be one of uni, mp, ray"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a whole number >= 1"),
    ({"data_parallel_size": -1}, "data_parallel_size must be a whole number >= 1"),
    ({"attention_backend": "flash"}, "attention_backend must be one of auto, torch, cpu"),
])
def test_unsupported_settings_fail_before_the_model_loads(kwargs, message, tmp_path):
    # The model path does not exist: the setting's error comes first, so nothing was loaded.
    with pytest.raises(ValueError, match=message):
        create_engine_config(EngineArgs(model=str(tmp_path / "missing.gguf"), **kwargs))


def test_the_executor_backend_defaults_to_a_process_per_rank_for_several_workers(tmp_path):
    from kestrel.engine.arg_utils import parallel_config
    assert parallel_config(EngineArgs()).distributed_executor_backend == "uni"
    assert parallel_config(EngineArgs(tensor_parallel_size=2)).distributed_executor_backend == "mp"
    assert parallel_config(EngineArgs(pipeline_parallel_size=2)).distributed_executor_backend == "mp"
    assert parallel_config(EngineArgs(data_parallel_size=2)).distributed_executor_backend == "uni"
    assert parallel_config(EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray")
                           ).distributed_executor_backend == "ray"


def test_parallel_flags_reach_the_config_check(capsys):
    assert main(["generate", "hi", "-tp", "2", "--distributed-executor-backend", "uni"]) == 1
    assert "'uni' runs one worker" in capsys.readouterr().err


def test_an_engine_runs_through_the_executor_and_reaches_its_worker():
    llm = LLM(max_model_len=128, kv_cache_memory=32 << 20, dtype="float32")
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    assert llm.llm_engine.config.parallel == ParallelConfig()
    assert executor.collective_rpc(lambda w: (w.rank, w.local_rank, w.world_size)) == [(0, 0, 1)]
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    executor.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        executor.collective_rpc(lambda w: w.rank)
