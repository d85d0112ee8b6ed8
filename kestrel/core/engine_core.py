"""The engine core: the `schedule → execute → update` loop over token ids.

It owns the scheduler and the KV-cache manager, and reaches the model only through an executor.
The offline `LLM` drives it in-process; the server runs it in its own process (busy loop).

With pipeline stages (`executor.max_concurrent_batches` > 1) a step is vLLM's batch queue: schedule and
submit another batch while there is room in the pipe and something to schedule, else wait for the
oldest batch and apply its results; so every stage works on a different batch at the same time.
Async scheduling is the same queue, two deep, with one worker: step N+1 is scheduled and submitted
while step N runs, then step N's results are applied (and go out to the front end) while N+1 runs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

from kestrel.config import EngineConfig
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.scheduler import Scheduler, StepTrace
from kestrel.core.structured_output import StructuredOutputManager
from kestrel.messages import EngineCoreOutputs, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput
from kestrel.model.loader import load_tokenizer, resolve_model
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
        self.kv_cache_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                               config.model.kv_groups.windows)
        model = config.model
        self.structured_output = StructuredOutputManager(
            lambda: load_tokenizer(resolve_model(model.tokenizer or model.model)), model.vocab_size,
            model.eos_token_id)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.structured_output)
        self.batch_queue_size = 2 if config.scheduler.async_scheduling else executor.max_concurrent_batches
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput, StepTrace | None]] = deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request.from_engine_core_request(request))

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs | None:
        """One step's outputs; with a batch queue, None when this call only submitted a batch."""
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        scheduler_output, step = self._schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self._update(scheduler_output, runner_output, step)

    def step_with_batch_queue(self) -> EngineCoreOutputs | None:
        if len(self.batch_queue) < self.batch_queue_size and self.scheduler.has_unfinished_requests() \
                and not self._needs_results_first():
            scheduler_output, step = self._schedule()
            # An output that schedules nothing still goes out when it carries news for the workers
            # (finished or preempted requests to drop); the scheduler does not repeat them.
            if (scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                    or scheduler_output.preempted_req_ids):
                future = self.executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((future, scheduler_output, step))
                if scheduler_output.total_num_scheduled_tokens and len(self.batch_queue) < self.batch_queue_size:
                    return None  # room for another batch: schedule it before waiting
        if not self.batch_queue:
            return None
        future, scheduler_output, step = self.batch_queue.popleft()
        return self._update(scheduler_output, future.result(), step)

    def _needs_results_first(self) -> bool:
        """Under async scheduling, a running constrained request's next bitmask needs the token of its
        step in flight: while one runs, steps do not overlap (the scheduler would leave it out)."""
        return (bool(self.batch_queue) and self.config.scheduler.async_scheduling
                and self.scheduler.has_constrained_running())

    def _schedule(self) -> tuple[SchedulerOutput, StepTrace | None]:
        """The next step, with when it started and how long scheduling took."""
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        return scheduler_output, StepTrace(start, time.monotonic() - start)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                step: StepTrace | None = None) -> EngineCoreOutputs:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output, step)
        if not self.has_unfinished_requests():
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

    def profile(self, start: bool) -> None:
        """Start or stop the torch profiler in every worker (with one worker, in this process: the
        engine core's own steps are in its trace too)."""
        self.executor.collective_rpc("profile", (start,))

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
