"""The front end for offline use: input processing, an in-process engine core, output processing.

    LLMEngine.add_request ─► Processor ─► EngineCore.add_request
    LLMEngine.step        ─► EngineCore.step ─► OutputProcessor ─► RequestOutputs
"""

from __future__ import annotations

import logging
import time

from kestrel.config import (INT8_KV_BLOCK, CacheConfig, DeviceConfig, EngineArgs, EngineConfig, SchedulerConfig,
                            resolve_bytes, resolve_device, resolve_dtype)
from kestrel.core.engine_core import EngineCore
from kestrel.engine.output_processor import OutputProcessor
from kestrel.engine.processor import Processor, PromptType
from kestrel.messages import SchedulerStats
from kestrel.model import model_config_from_hf
from kestrel.model.loader import ModelSource, load_config, load_tokenizer, resolve_model
from kestrel.outputs import RequestOutput
from kestrel.sampling_params import SamplingParams
from kestrel.worker.executor import UniProcExecutor

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
KV_CACHE_DTYPES = ("auto", "int8")


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource, object]:
    """Resolve the model, read its config and tokenizer, and fix every setting: (config, source,
    tokenizer)."""
    source = resolve_model(args.model)
    hf_config = load_config(source)
    tokenizer = load_tokenizer(resolve_model(args.tokenizer) if args.tokenizer else source)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else _first(hf_config.eos_token_id)
    model = model_config_from_hf(hf_config, model=args.model, dtype=dtype, max_model_len=args.max_model_len,
                                 eos_token_id=eos, bos_token_id=_first(getattr(hf_config, "bos_token_id", None)),
                                 quantization=args.quantization)
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {args.max_num_seqs}")
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {args.block_size}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if args.kv_cache_dtype == "int8" and args.block_size != INT8_KV_BLOCK:
        raise ValueError(f"--kv-cache-dtype int8 stores K in blocks of {INT8_KV_BLOCK} tokens; "
                         f"--block-size {args.block_size} is not supported with it")
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill else max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, model.max_model_len)
    if budget < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {budget}")
    if not args.enable_chunked_prefill and budget < model.max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({budget}) must be at least "
                         f"max_model_len ({model.max_model_len})")
    config = EngineConfig(
        model=model,
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=resolve_bytes("kv_cache_memory", args.kv_cache_memory),
                          num_kv_blocks=args.num_kv_blocks,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=model.max_model_len,
                                  enable_chunked_prefill=args.enable_chunked_prefill),
        device=DeviceConfig(device),
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        disable_log_stats=args.disable_log_stats,
        attention_backend=args.attention_backend,
    )
    return config, source, tokenizer


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) and value else value


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource, tokenizer) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.processor = Processor(config.model, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.engine_core = EngineCore(config, UniProcExecutor(config, source))
        self.last_stats: SchedulerStats | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        config, source, tokenizer = create_engine_config(args)
        return cls(config, source, tokenizer)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue one request; raises ValueError (queueing nothing) on bad input."""
        arrival_time = arrival_time if arrival_time is not None else time.time()
        text, ids, core_requests = self.processor.process(request_id, prompt, params, arrival_time, priority)
        self.output_processor.add_request(request_id, text, ids, params,
                                          [r.request_id for r in core_requests], arrival_time)
        for request in core_requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def get_tokenizer(self):
        return self.tokenizer
