"""How the engine core reaches its workers, as vLLM V1's executors do.

An executor owns the engine core's workers (one per tensor x pipeline rank) and offers one primitive,
`collective_rpc`: call a method on every worker and return their answers in rank order. The engine
core's needs are written on top of it: the KV pool is the smallest any worker can hold, and a step's
tokens come from the output rank (the first tensor rank of the last pipeline stage, which samples).

Kinds, chosen in one place (`Executor.get_class`) from `ParallelConfig.distributed_executor_backend`:
uni (`UniProcExecutor`: one worker in the engine core's own process, the default). mp (a process per
rank) and ray (actors) are the next step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from kestrel.config import EngineConfig, ParallelConfig
from kestrel.messages import ModelRunnerOutput, SchedulerOutput
from kestrel.model.loader import ModelSource
from kestrel.worker.worker import Worker

# A worker method by name, or a function called with the worker first.
WorkerMethod = str | Callable[..., Any]


class Executor(ABC):
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.source = source
        self.parallel_config = config.parallel
        self._init_executor()

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type[Executor]:
        """The executor for these settings, or a ValueError naming what is supported."""
        backend = parallel_config.distributed_executor_backend
        if parallel_config.world_size != 1:
            raise ValueError(f"tensor_parallel_size {parallel_config.tensor_parallel_size} x "
                             f"pipeline_parallel_size {parallel_config.pipeline_parallel_size} is not supported yet: "
                             "Kestrel runs one worker per engine core (both sizes 1)")
        if backend != "uni":
            raise ValueError(f"distributed_executor_backend {backend!r} is not supported yet; supported: "
                             "'uni' (one worker in the engine core's process)")
        return UniProcExecutor

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model on each."""

    @abstractmethod
    def collective_rpc(self, method: WorkerMethod, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on every worker (`worker.method(*args, **kwargs)`, or `method(worker, *args,
        **kwargs)` for a function) and return the answers in rank order."""

    @property
    def output_rank(self) -> int:
        """The rank whose answer to execute_model is the step's: the last pipeline stage samples,
        and its first tensor rank answers."""
        return self.parallel_config.world_size - self.parallel_config.tensor_parallel_size

    def determine_num_kv_blocks(self) -> int:
        # Every worker holds its share of every block, so the pool is as large as the smallest allows.
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""


def call_worker(worker: Worker, method: WorkerMethod, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None) -> Any:
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


class UniProcExecutor(Executor):
    """One worker, rank 0 of a world of one, in the engine core's own process: an RPC is a call."""

    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = Worker(self.config, self.source, rank=0, local_rank=0)

    def collective_rpc(self, method: WorkerMethod, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self.driver_worker is None:
            raise RuntimeError("the executor has been shut down")
        return [call_worker(self.driver_worker, method, args, kwargs)]

    def shutdown(self) -> None:
        self.driver_worker = None
