"""How the engine core reaches its workers. One device: the worker lives in the engine core's own
process. (Tensor-parallel and multi-machine executors will implement the same three methods.)"""

from __future__ import annotations

from typing import Protocol

from kestrel.config import EngineConfig
from kestrel.messages import ModelRunnerOutput, SchedulerOutput
from kestrel.model.loader import ModelSource
from kestrel.worker.worker import Worker


class Executor(Protocol):
    def determine_num_kv_blocks(self) -> int: ...
    def initialize_kv_cache(self, num_blocks: int) -> None: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def shutdown(self) -> None: ...


class UniProcExecutor:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.worker = Worker(config, source)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None
