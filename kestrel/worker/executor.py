"""How the engine core reaches its workers, as vLLM V1's executors do.

An executor owns the engine core's workers (one per tensor x pipeline rank) and offers one primitive,
`collective_rpc`: call a method on every worker and return their answers in rank order. The engine
core's needs are written on top of it: the KV pool is the smallest any worker can hold, and a step's
tokens come from the output rank (the first tensor rank of the last pipeline stage, which samples).

Kinds, chosen in one place (`executor_class`, kestrel/worker/select_executor.py) from
`ParallelConfig.distributed_executor_backend`: uni (`UniProcExecutor`: one worker in the engine
core's own process, the default for one worker), mp (`MultiprocExecutor`: a process per rank on this
machine, the default for more) and ray (`RayExecutor`: Ray actors in a placement group, on one
machine or a cluster).

With pipeline stages, several steps are in flight at once (`max_concurrent_batches`, one per stage):
`execute_model(..., non_block=True)` returns a future, and the engine core keeps a queue of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kestrel.config import EngineConfig
from kestrel.distributed.thread_governor import mark_frontend
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
        mark_frontend()  # an in-process engine: worker processes count this one as Kestrel's
        self._init_executor()

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

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may have in flight at once: one per pipeline stage."""
        return self.parallel_config.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """The step's sampled tokens; with `non_block`, a future of them."""
        output = self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]
        return _done(output) if non_block else output

    def register_failure_callback(self, callback: Callable[[Exception], None]) -> None:
        """`callback(error)` is called (from another thread) if a worker dies or fails outside a call
        the engine core is waiting on; executors whose workers live in this process have none."""
        del callback

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free what they hold."""


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def call_worker(worker: Worker, method: WorkerMethod, args: tuple[Any, ...],
                kwargs: dict[str, Any] | None) -> Any:
    if isinstance(method, str):
        return getattr(worker, method)(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


class UniProcExecutor(Executor):
    """One worker, rank 0 of a world of one, in the engine core's own process: an RPC is a call.
    Under async scheduling a step runs on a thread of its own, so that the engine core can plan the
    next one meanwhile (torch's kernels leave the GIL while they compute); steps run one at a time, in
    the order they were submitted."""

    def _init_executor(self) -> None:
        self.driver_worker: Worker | None = Worker(self.config, self.source, rank=0, local_rank=0)
        self._step_thread = (ThreadPoolExecutor(1, thread_name_prefix="kestrel-step")
                             if self.config.scheduler.async_scheduling else None)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block and self._step_thread is not None:
            return self._step_thread.submit(lambda: self.collective_rpc("execute_model", (scheduler_output,))[0])
        return super().execute_model(scheduler_output, non_block)

    def collective_rpc(self, method: WorkerMethod, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self.driver_worker is None:
            raise RuntimeError("the executor has been shut down")
        return [call_worker(self.driver_worker, method, args, kwargs)]

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.driver_worker = None
