"""Engine settings from the outside in: `EngineArgs` (everything a user may set), the engine flags
(named as vLLM names them, one line each in ENGINE_FLAGS, shared by every command that starts an
engine and by the API server) and `create_engine_config`, which turns `EngineArgs` into the frozen,
validated `EngineConfig` (kestrel/config.py) that every layer below reads.

Every setting is checked here, before anything is loaded or started: a bad value is a ValueError
naming the setting and what it accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any

from kestrel import config as _config
from kestrel import ops
from kestrel.config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    INT8_KV_BLOCK,
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_bytes,
    resolve_device,
    resolve_dtype,
)
from kestrel.model import check_shardable, model_config_from_hf
from kestrel.model.loader import ModelSource, load_config, load_tokenizer, resolve_model
from kestrel.worker.select_executor import executor_class

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


# ---- what a user sets ---------------------------------------------------------------------------

@dataclasses.dataclass
class EngineArgs:
    """Everything a user may set, from Python (`LLM(**kwargs)`) or the command line."""
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"                     # auto | bfloat16 | float16 | float32
    quantization: str | None = None         # None | int8 | none
    device: str = "auto"                    # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None  # bytes, or a size such as "2GiB"
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"            # auto | int8
    seed: int = 0
    enforce_eager: bool = False
    disable_log_stats: bool = False
    attention_backend: str = "auto"         # auto | torch | cpu
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni | mp | ray; None: uni for one worker, else mp
    speculative_config: dict | str | None = None     # vLLM's JSON: {"method": "ngram", ...}
    async_scheduling: bool = False          # plan step N+1 while step N runs (one worker, no speculation)
    request_trace_buffer: int = 0           # the last N requests' traces kept by the server; 0: off
    otlp_traces_endpoint: str | None = None  # export request traces as OpenTelemetry spans (OTLP/HTTP)
    torch_profiler_dir: str | None = None   # /start_profile and /stop_profile write torch profiler traces here
    cpu_threads: int | str = "auto"         # auto (adaptive pool) or N: each CPU worker's torch threads, pinned

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


# ---- flags --------------------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """argparse type: '2GiB' -> 2147483648, '512MiB', '1.5GB' (decimal), '4096' (bytes)."""
    try:
        return _config.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_json_object(text: str) -> dict:
    """argparse type: a JSON object, such as --speculative-config's."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    flag: str
    field: str                      # the EngineArgs field it sets
    type: Callable[[str], Any] | None = None
    help: str = ""
    action: Any = None              # argparse action for switches; None: takes a value of `type`
    aliases: tuple[str, ...] = ()   # short spellings, as vLLM's (-tp, -pp, -dp)


# One line per engine flag. Flags not given on the command line leave EngineArgs' default.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("--model", "model", str, "a .gguf file or a model folder (default: the embedded SmolLM2-135M-Instruct)"),
    EngineFlag("--dtype", "dtype", str, "auto, bfloat16, float16 or float32"),
    EngineFlag("--quantization", "quantization", str,
               "int8: the decoder layers' matrices in int8, activations quantized per token (W8A8); none: a "
               "GGUF file's quantized matrices dequantized to --dtype at load (default: run Q8_0, Q6_K, Q4_K, "
               "Q4_1, Q4_0 and Q5 blocks as the file stores them)"),
    EngineFlag("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    EngineFlag("--max-model-len", "max_model_len", int, "context length (default: the model's)"),
    EngineFlag("--max-num-seqs", "max_num_seqs", int, "most sequences in one step"),
    EngineFlag("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    EngineFlag("--block-size", "block_size", int, "tokens per KV-cache block"),
    EngineFlag("--enable-prefix-caching", "enable_prefix_caching", help="reuse KV blocks of shared prefixes",
               action=argparse.BooleanOptionalAction),
    EngineFlag("--enable-chunked-prefill", "enable_chunked_prefill", help="split long prompts across steps",
               action=argparse.BooleanOptionalAction),
    EngineFlag("--gpu-memory-utilization", "gpu_memory_utilization", float, "fraction of GPU memory to use"),
    EngineFlag("--kv-cache-memory", "kv_cache_memory", parse_bytes, "KV-cache size in bytes, e.g. 2GiB, 512MiB"),
    EngineFlag("--num-kv-blocks", "num_kv_blocks", int, "exact number of KV-cache blocks"),
    EngineFlag("--kv-cache-dtype", "kv_cache_dtype", str,
               "auto (the model's dtype) or int8: K and V rows in int8 with a scale each, ~1.9x the tokens"),
    EngineFlag("--attention-backend", "attention_backend", str,
               f"{', '.join(ATTENTION_BACKENDS)}: auto picks the fastest for the device and cache dtype"),
    EngineFlag("--seed", "seed", int, "random seed (engine, and the sampling seed of generate/chat)"),
    EngineFlag("--enforce-eager", "enforce_eager", action="store_true",
               help="run decode steps through the model's forward: no captured graph, no CPU decode plan"),
    EngineFlag("--disable-log-stats", "disable_log_stats", action="store_true",
               help="do not log the engine's throughput, queue and KV-cache stats every few seconds"),
    EngineFlag("--tensor-parallel-size", "tensor_parallel_size", int,
               "tensor-parallel ranks: each holds a share of every layer's heads and weights", aliases=("-tp",)),
    EngineFlag("--pipeline-parallel-size", "pipeline_parallel_size", int,
               "pipeline stages: each holds a consecutive share of the layers", aliases=("-pp",)),
    EngineFlag("--data-parallel-size", "data_parallel_size", int,
               "engine cores, each with its own scheduler, KV cache and workers, behind one front end that sends "
               "each request to the least-loaded core; with one worker each, the CPU cores are split between them",
               aliases=("-dp",)),
    EngineFlag("--distributed-executor-backend", "distributed_executor_backend", str,
               f"how the engine core reaches its workers: {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)} "
               "(uni: one worker in the engine core's process; mp: a process per rank; ray: Ray actors); "
               "default uni for one worker, mp for more"),
    EngineFlag("--speculative-config", "speculative_config", parse_json_object,
               'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
               '"prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts tokens by looking the last n-gram up in the '
               'context; {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} drafts them with a '
               "smaller model"),
    EngineFlag("--request-trace-buffer", "request_trace_buffer", int,
               "keep a timed trace of the last N requests, read at GET /v1/requests/{id}/trace; 0: off"),
    EngineFlag("--otlp-traces-endpoint", "otlp_traces_endpoint", str,
               "send each request's trace as OpenTelemetry spans to this OTLP/HTTP collector (e.g. "
               "http://localhost:4318)"),
    EngineFlag("--torch-profiler-dir", "torch_profiler_dir", str,
               "turn on POST /start_profile and /stop_profile: torch profiler traces of the engine core's "
               "worker(s), written to this folder"),
    EngineFlag("--cpu-threads", "cpu_threads", str,
               "torch threads of each CPU worker: auto sizes the pool from the cores the process may use (affinity, "
               "cgroup quota; one left to the API server from 4 cores up) and shrinks it while other processes "
               "take cores, growing it back when they leave; N pins it at N"),
    EngineFlag("--async-scheduling", "async_scheduling", action=argparse.BooleanOptionalAction,
               help="schedule step N+1 and send step N-1's tokens out while step N's forward runs "
                    "(one worker, no speculative decoding)"),
)


def _engine_default(field: str) -> Any:
    f = EngineArgs.__dataclass_fields__[field]
    return f.default if f.default is not dataclasses.MISSING else None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine flags")
    for f in ENGINE_FLAGS:
        default = _engine_default(f.field)
        help_text = f"{f.help} (default: {default})" if default is not None else f.help
        kwargs: dict[str, Any] = dict(dest=f.field, default=argparse.SUPPRESS, help=help_text)
        if f.action is not None:
            kwargs["action"] = f.action
        else:
            kwargs["type"] = f.type
            kwargs["metavar"] = f.field.upper()
        group.add_argument(f.flag, *f.aliases, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments for the engine flags given on the command line."""
    return {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if hasattr(args, f.field)}


# ---- EngineArgs -> EngineConfig -----------------------------------------------------------------

def settings_without_model(args: EngineArgs) -> tuple[SpeculativeConfig | None, ParallelConfig]:
    """The settings that need no model, checked: (speculative, parallel). A bad flag fails here, before
    any model is read or any process started."""
    check_settings(args)
    check_optional_packages(args)
    speculative = speculative_config(args.speculative_config)
    parallel = parallel_config(args)
    check_parallel_supported(parallel)
    check_async_scheduling(args.async_scheduling, parallel, speculative)
    return speculative, parallel


# The optional integrations (`make install` installs both; `pip install 'kestrel[ray,otel]'` elsewhere):
# the flag that needs each, and the package it imports.
OPTIONAL_PACKAGES = (("distributed_executor_backend", "ray", "ray", "ray"),
                     ("otlp_traces_endpoint", None, "opentelemetry.sdk", "otel"))


def check_optional_packages(args: EngineArgs) -> None:
    """A flag whose optional package is not installed is a clear error before anything starts."""
    for field, value, module, extra in OPTIONAL_PACKAGES:
        given = getattr(args, field)
        wanted = given is not None and (value is None or given == value)
        if wanted and importlib.util.find_spec(module) is None:
            flag = "--" + field.replace("_", "-")
            package = module.replace(".", "-")
            raise ValueError(f"{flag} {given} needs the package {package}, which is not installed: "
                             f"pip install 'kestrel[{extra}]'")


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource, Any]:
    """Resolve the model, read its config and tokenizer, and fix every setting: (config, source,
    tokenizer). Settings that need no model are checked first, so a bad flag fails fast."""
    speculative, parallel = settings_without_model(args)
    source = resolve_model(args.model)
    hf_config = load_config(source)
    tokenizer = load_tokenizer(resolve_model(args.tokenizer) if args.tokenizer else source)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, ops.cpu_prefers_bf16)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else _first(hf_config.eos_token_id)
    model = model_config_from_hf(hf_config, model=args.model, dtype=dtype, max_model_len=args.max_model_len,
                                 eos_token_id=eos, bos_token_id=_first(getattr(hf_config, "bos_token_id", None)),
                                 quantization=args.quantization)
    if args.tokenizer:
        model = dataclasses.replace(model, tokenizer=args.tokenizer)
    check_shardable(model, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    config = EngineConfig(
        model=model,
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=resolve_bytes("kv_cache_memory", args.kv_cache_memory),
                          num_kv_blocks=args.num_kv_blocks,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=scheduler_config(args, model.max_model_len, speculative),
        device=DeviceConfig(device, cpu_threads=resolve_cpu_threads(args.cpu_threads)),
        parallel=parallel,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        disable_log_stats=args.disable_log_stats,
        attention_backend=args.attention_backend,
        speculative=speculative,
        draft_model=draft_model_config(speculative, model, parallel),
        request_trace_buffer=args.request_trace_buffer,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        torch_profiler_dir=os.path.abspath(args.torch_profiler_dir) if args.torch_profiler_dir else None,
    )
    return config, source, tokenizer


def resolve_cpu_threads(value: int | str) -> int | None:
    """--cpu-threads: "auto" -> None (the adaptive pool), or a whole number >= 1 (pinned)."""
    if value == "auto":
        return None
    try:
        threads = int(value)
    except (TypeError, ValueError):
        threads = 0
    if isinstance(value, bool) or threads < 1:
        raise ValueError(f"cpu_threads must be 'auto' or a whole number >= 1, got {value!r}")
    return threads


def check_settings(args: EngineArgs) -> None:
    """The settings that can be checked without the model."""
    if args.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {args.max_num_seqs}")
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {args.block_size}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if args.kv_cache_dtype == "int8" and args.block_size != INT8_KV_BLOCK:
        raise ValueError(f"--kv-cache-dtype int8 stores K in blocks of {INT8_KV_BLOCK} tokens; "
                         f"--block-size {args.block_size} is not supported with it")
    if args.request_trace_buffer < 0:
        raise ValueError(f"request_trace_buffer must be 0 (off) or more, got {args.request_trace_buffer}")
    if args.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                         f"got {args.attention_backend!r}")
    resolve_cpu_threads(args.cpu_threads)


def speculative_config(value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """`speculative_config` as given from Python (a dict, JSON text or the config) or the command line."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config {value!r} is not valid JSON: {exc}") from None
    return SpeculativeConfig.from_dict(value)


def draft_model_config(speculative: SpeculativeConfig | None, target: ModelConfig,
                       parallel: ParallelConfig) -> ModelConfig | None:
    """The draft model's shape (method draft_model), read like the target's: the target's dtype and
    context length, and the target's vocabulary, or a ValueError that says what does not fit."""
    if speculative is None or speculative.method != "draft_model":
        return None
    if parallel.world_size != 1:
        raise ValueError("speculative_config: the draft_model method runs with one worker per engine core; "
                         f"tensor_parallel_size {parallel.tensor_parallel_size} x pipeline_parallel_size "
                         f"{parallel.pipeline_parallel_size} is not supported with it yet")
    if target.kv_groups.num_groups > 1:
        raise ValueError("speculative_config: the draft_model method is not supported yet for a model that mixes "
                         "full and sliding-window attention layers; use the ngram method")
    try:
        source = resolve_model(speculative.model)
        hf_config = load_config(source)
        draft = model_config_from_hf(hf_config, model=speculative.model, dtype=target.dtype,
                                     max_model_len=target.max_model_len, eos_token_id=target.eos_token_id,
                                     bos_token_id=target.bos_token_id, quantization=None)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config: draft model {speculative.model!r}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) is not the "
                         f"target's ({target.vocab_size}); a draft model must share the target's tokenizer")
    return draft


def parallel_config(args: EngineArgs) -> ParallelConfig:
    """The sizes as given; the executor backend, when not given, is uni for one worker and mp for more
    (as vLLM chooses on one machine)."""
    backend = args.distributed_executor_backend
    if backend is None:
        backend = "uni" if args.tensor_parallel_size == args.pipeline_parallel_size == 1 else "mp"
    return ParallelConfig(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size, backend)


def check_parallel_supported(parallel: ParallelConfig) -> None:
    """Workers the executors cannot run are an error here rather than a crash later. Any number of
    data-parallel engine cores is supported: each is its own process behind the front end."""
    executor_class(parallel)


def check_async_scheduling(enabled: bool, parallel: ParallelConfig, speculative: SpeculativeConfig | None) -> None:
    """What async scheduling cannot run with yet is an error at start-up, not a wrong token later."""
    if not enabled:
        return
    if speculative is not None:
        raise ValueError("async_scheduling does not work with speculative decoding yet: the next step's drafts "
                         "depend on the tokens of the step still running; use one or the other")
    if parallel.world_size != 1:
        # Only the output rank samples; the others learn the tokens from the next step's scheduler output,
        # which under async scheduling does not have them yet.
        raise ValueError(f"async_scheduling runs with one worker per engine core; tensor_parallel_size "
                         f"{parallel.tensor_parallel_size} x pipeline_parallel_size "
                         f"{parallel.pipeline_parallel_size} is not supported with it yet "
                         "(data parallelism is)")


def scheduler_config(args: EngineArgs, max_model_len: int,
                     speculative: SpeculativeConfig | None = None) -> SchedulerConfig:
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if args.enable_chunked_prefill else max(
            DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
    if budget < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {budget}")
    if not args.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(f"without chunked prefill, max_num_batched_tokens ({budget}) must be at least "
                         f"max_model_len ({max_model_len})")
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                           max_model_len=max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                           num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
                           num_lookahead_tokens=(speculative.num_speculative_tokens
                                                 if speculative and speculative.method == "draft_model" else 0),
                           speculative_disable_by_batch_size=speculative.disable_by_batch_size if speculative else None,
                           async_scheduling=args.async_scheduling,
                           trace_requests=args.request_trace_buffer > 0 or args.otlp_traces_endpoint is not None)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value
