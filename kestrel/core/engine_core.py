"""The engine core: the `schedule → execute → update` loop over token ids.

It owns the scheduler and the KV-cache manager, and reaches the model only through an executor.
The offline `LLM` drives it in-process; the server runs it in its own process (busy loop).
"""

from __future__ import annotations

import logging

from kestrel.config import EngineConfig
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.scheduler import Scheduler
from kestrel.messages import EngineCoreOutputs, EngineCoreRequest
from kestrel.worker.executor import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        num_blocks = executor.determine_num_kv_blocks()
        executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        cache = config.cache
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, cache.block_size)
        self.kv_cache_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not self.scheduler.has_unfinished_requests():
            self.check_invariants()  # cheap, and only when the engine goes idle
        return outputs

    def check_invariants(self) -> None:
        """free + in-use blocks == total, and only live requests hold blocks."""
        self.kv_cache_manager.check_invariants()
        live = set(self.scheduler.requests)
        holders = set(self.kv_cache_manager.req_to_blocks)
        assert holders <= live, f"finished requests still hold blocks: {holders - live}"

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
