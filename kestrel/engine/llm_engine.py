"""The front end for offline use: input processing, the engine core, output processing.

    LLMEngine.add_request ─► Processor ─► EngineCore.add_requests
    LLMEngine.step        ─► EngineCore.step ─► OutputProcessor ─► RequestOutputs

One engine core runs in this process. With `data_parallel_size` D > 1 there are D engine-core
processes instead (`SyncEngineCoreClient`, the same calls): each request goes to the least-loaded
one, and a step hands over whatever the cores have finished since the last.
"""

from __future__ import annotations

import logging
import time

from kestrel.config import EngineConfig
from kestrel.core.engine_core import EngineCore
from kestrel.engine.arg_utils import EngineArgs, create_engine_config
from kestrel.engine.core_client import SyncEngineCoreClient
from kestrel.engine.exceptions import EngineDeadError
from kestrel.engine.output_processor import OutputProcessor
from kestrel.engine.processor import Processor, PromptType
from kestrel.engine.stat_logger import LoggingStatLogger
from kestrel.messages import SchedulerStats, SpecDecodingStats
from kestrel.model.loader import ModelSource
from kestrel.outputs import RequestOutput
from kestrel.sampling_params import SamplingParams
from kestrel.worker.select_executor import executor_class

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource, tokenizer) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.processor = Processor(config.model, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.engine_core: EngineCore | SyncEngineCoreClient = (
            EngineCore(config, executor_class(config.parallel)(config, source))
            if config.parallel.data_parallel_size == 1 else SyncEngineCoreClient(config, source))
        self.last_stats: SchedulerStats | None = None
        self.spec_decoding_stats = SpecDecodingStats()  # totals since start (speculative decoding)
        self.stat_logger = LoggingStatLogger.from_config(config)
        self.error: EngineDeadError | None = None  # set when a step fails: the engine serves no more

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        config, source, tokenizer = create_engine_config(args)
        return cls(config, source, tokenizer)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue one request; raises ValueError (queueing nothing) on bad input."""
        self._check_alive()
        arrival_time = arrival_time if arrival_time is not None else time.time()
        text, ids, core_requests = self.processor.process(request_id, prompt, params, arrival_time, priority)
        self.output_processor.add_request(request_id, text, ids, params,
                                          [r.request_id for r in core_requests], arrival_time)
        self.engine_core.add_requests(core_requests)

    def abort_request(self, request_ids: list[str]) -> None:
        children = self.output_processor.abort_requests(request_ids)
        if self.error is None:  # after a failed step the engine core's state is not touched again
            self.engine_core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step. If it raises, the engine is dead: `EngineDeadError` (the cause
        chained), now and on every later call."""
        self._check_alive()
        try:
            outputs = self.engine_core.step()
        except Exception as e:
            self.error = EngineDeadError(f"the engine failed in a step: {type(e).__name__}: {e}")
            raise self.error from e
        if outputs is None:  # a pipeline's batch was only submitted
            return []
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
            self.stat_logger.record(outputs.scheduler_stats)
            if outputs.scheduler_stats.spec_decoding is not None:
                self.spec_decoding_stats.add(outputs.scheduler_stats.spec_decoding)
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"{self.error}; create a new engine")

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine core's workers (or the engine-core processes); the engine serves no more."""
        self.engine_core.shutdown()
