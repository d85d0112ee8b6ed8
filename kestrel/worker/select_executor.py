"""The one place that turns `--distributed-executor-backend` into an executor class."""

from __future__ import annotations

from kestrel.config import ParallelConfig
from kestrel.worker.executor import Executor, UniProcExecutor


def executor_class(parallel_config: ParallelConfig) -> type[Executor]:
    """The executor for these settings, or a ValueError naming what fits. Ray is imported only when
    asked for."""
    backend = parallel_config.distributed_executor_backend
    if backend == "uni":
        if parallel_config.world_size != 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker, but tensor_parallel_size "
                             f"{parallel_config.tensor_parallel_size} x pipeline_parallel_size "
                             f"{parallel_config.pipeline_parallel_size} needs {parallel_config.world_size}; "
                             "use 'mp' (a process per rank) or 'ray'")
        return UniProcExecutor
    if backend == "mp":
        from kestrel.worker.multiproc_executor import MultiprocExecutor
        return MultiprocExecutor
    if backend == "ray":
        from kestrel.worker.ray_executor import RayExecutor
        return RayExecutor
    raise ValueError(f"distributed_executor_backend {backend!r} is not one of uni, mp, ray")
