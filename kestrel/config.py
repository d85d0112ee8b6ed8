"""Engine configuration: the frozen, validated configs each box reads (`EngineConfig` and its parts),
and the helpers that resolve a setting's value. What a user sets (`EngineArgs`, named as vLLM names
them) lives beside `create_engine_config` in kestrel/engine/arg_utils.py, which builds these; every
layer below the engine takes only these frozen configs.

Nothing here loads weights; `ModelConfig` is filled from the model's config once, at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kestrel import platform

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30  # as vLLM's CPU backend: 4 GiB unless --kv-cache-memory says otherwise
# The int8 KV cache stores K transposed within blocks of this many tokens (its kernels' vector width),
# so an int8 cache needs --block-size equal to it.
INT8_KV_BLOCK = 16
KV_CACHE_DTYPES = ("auto", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "cpu")
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None
    architecture: str          # the checkpoint's model_type: a key of kestrel.model.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool              # Qwen3 normalises q and k per head before rotary
    eos_token_id: int | None
    bos_token_id: int | None
    dtype: torch.dtype
    max_model_len: int
    # None: the checkpoint's own (a GGUF file's blocks kept); "int8": the decoder projections in int8
    # (W8A8); "none": a GGUF file's blocks dequantized to dtype at load
    quantization: str | None = None
    tokenizer: str | None = None     # the tokenizer's path when it is not the model's
    # Sliding-window attention: the window W (a token sees itself and the W - 1 keys before it) of the
    # layers whose type is "sliding_attention" in layer_types (None there: every layer, as Mistral's).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None   # per layer, "full_attention" or "sliding_attention"
    local_rope_theta: float | None = None        # the sliding layers' own rope base (Gemma 3), else rope_theta's
    query_pre_attn_scalar: float | None = None   # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    hidden_act: str = "silu"                     # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    # Granite's multipliers: of the embedding, of each block's output before the residual add, the
    # attention scale (instead of 1/sqrt(head_dim)), and the divisor of the logits.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    partial_rotary_factor: float = 1.0           # the share of each head's dimensions rotated (Phi-4: 0.75)
    # Gemma 2's soft caps: scores (and logits) s become cap * tanh(s / cap); None: none
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each q/k head that rotary rotates: the first ones, as Hugging Face's."""
        return int(self.head_dim * self.partial_rotary_factor)

    @functools.cached_property
    def kv_groups(self) -> KVCacheGroups:
        return kv_cache_groups([self.window_of(layer) for layer in range(self.num_layers)])

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (over the whole model), None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token in every layer: in the model's dtype, or int8 plus a float32 scale per
        (token, KV head) row."""
        if kv_cache_dtype == "int8":
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 4)
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's layers grouped by attention type for the KV cache (vLLM's hybrid KV-cache manager).

    Each group has its own block table per request over the one block pool, and a block holds
    `group_size` layer slots: layer l keeps its K and V in slot layer_slots[l] of the blocks of group
    layer_groups[l]. A model of one attention type is one group of every layer (as if there were no
    groups); a model mixing full and sliding-window layers (Gemma 2 and 3) has groups of equal size
    (the fewest layers of a type; a type's last group may be short, its spare slots unused), so that
    a sliding-window group can let go of the blocks that fall wholly out of its window while the full
    groups keep a request's every block.

    Invariant: every group of a type has that type's window; groups are numbered full types first."""
    windows: tuple[int | None, ...]   # per group: its sliding window, None for full attention
    layer_groups: tuple[int, ...]     # per layer of the whole model
    layer_slots: tuple[int, ...]      # per layer: its slot in its group's blocks, 0 .. group_size - 1
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def max_blocks_held(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once over all groups, its prompt in
        chunks of at most `max_chunk` tokens: all its blocks in a full group, in a sliding one those of
        its window and of the chunk being computed."""
        whole = -(-num_tokens // block_size)
        return sum(whole if w is None else min(whole, -(-(w + max_chunk) // block_size) + 1) for w in self.windows)


def kv_cache_groups(windows_by_layer: Sequence[int | None]) -> KVCacheGroups:
    """The groups for layers with these windows (None: full attention)."""
    types = sorted(set(windows_by_layer), key=lambda w: (w is not None, w or 0))
    layers_of = {t: [i for i, w in enumerate(windows_by_layer) if w == t] for t in types}
    group_size = min(len(layers) for layers in layers_of.values())
    windows: list[int | None] = []
    layer_groups = [0] * len(windows_by_layer)
    layer_slots = [0] * len(windows_by_layer)
    for t in types:
        layers = layers_of[t]
        for start in range(0, len(layers), group_size):
            for slot, layer in enumerate(layers[start:start + group_size]):
                layer_groups[layer], layer_slots[layer] = len(windows), slot
            windows.append(t)
    return KVCacheGroups(tuple(windows), tuple(layer_groups), tuple(layer_slots), group_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None     # bytes; overrides the budget on any device
    num_kv_blocks: int | None = None       # exact pool size (tests use it to force preemption)
    kv_cache_dtype: str = "auto"           # auto (the model's dtype) | int8


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0   # most draft tokens scheduled per request and step
    # KV slots held past a sampling request's scheduled tokens, for the drafts a draft model writes
    # into the cache before the next step (method draft_model: num_speculative_tokens).
    num_lookahead_tokens: int = 0
    speculative_disable_by_batch_size: int | None = None  # no drafts while this many requests run
    trace_requests: bool = False      # record each request's timed events (request traces on)
    # Schedule step N+1 while step N runs: a request whose token is being sampled is scheduled again
    # with a placeholder for it (see kestrel/core/scheduler.py).
    async_scheduling: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    # Torch threads of each CPU worker: None sizes the pool from the usable cores and resizes it while
    # neighbours take cores (kestrel/distributed/thread_governor.py); a number pins it.
    cpu_threads: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How many workers an engine core drives and how many engine cores serve, as vLLM counts them:
    tensor x pipeline parallel ranks under one engine core (its world), data-parallel engine cores
    beside each other. `distributed_executor_backend` says how the engine core reaches its workers:
    uni (one worker in the engine core's own process), mp (a process per rank), ray (actors)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    data_parallel_rank: int = 0   # which engine core this is, 0 .. data_parallel_size - 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {size!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {self.data_parallel_rank} is outside "
                             f"data_parallel_size {self.data_parallel_size}")

    @property
    def world_size(self) -> int:
        """Workers under one engine core: every (pipeline stage, tensor rank) pair."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_local_workers(self) -> int:
        """Workers of every engine core together (all on this machine unless Ray places them)."""
        return self.world_size * self.data_parallel_size


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON: a proposer drafts up to
    `num_speculative_tokens` tokens per request and step, and the target model verifies them all in
    its next forward. `ngram` looks the context's last n-gram (`prompt_lookup_max` down to
    `prompt_lookup_min` tokens) up in the context itself; `draft_model` runs `model`, a smaller model
    with the same vocabulary, beside the target in the same worker."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    # No drafts in a step while this many requests or more are running: a wide batch is compute-bound,
    # and rejected drafts then cost about what accepted ones save (vLLM's key).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a whole number >= 1, got {value!r}")
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a whole number >= 1, got {size!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs a \"model\" (a path to the draft "
                             "model), and only draft_model takes one")

    @classmethod
    def from_dict(cls, value: dict) -> SpeculativeConfig:
        """From vLLM's JSON keys; `method` may be left out when `model` is given (a draft model)."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        value = dict(value)
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else None
        if value["method"] == "ngram" and "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = min(cls.prompt_lookup_min, value["prompt_lookup_max"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    seed: int = 0
    enforce_eager: bool = False        # True: decode steps through the model's forward, never a decode plan
    disable_log_stats: bool = False
    attention_backend: str = "auto"    # auto | torch | cpu: see kestrel/attention
    speculative: SpeculativeConfig | None = None
    # The draft model's shape (speculative method draft_model): read at start-up like the target's.
    draft_model: ModelConfig | None = None
    request_trace_buffer: int = 0      # traces of the last N requests kept by the front end; 0: off
    otlp_traces_endpoint: str | None = None  # where request traces go as OpenTelemetry spans
    torch_profiler_dir: str | None = None   # where /start_profile ... /stop_profile traces go; None: off

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


_BYTE_UNITS = {"": 1, "b": 1,
               "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5GB' (decimal), '4096' (bytes); ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"{text!r} is not a size in bytes; write e.g. 4096, 512MiB, 2GiB or 1.5GB")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def resolve_bytes(name: str, value: int | str | None) -> int | None:
    """A size setting given from Python as bytes or as text ('2GiB'), checked: None, or bytes >= 1."""
    if value is None:
        return None
    size = parse_bytes(value) if isinstance(value, str) else value
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be a positive number of bytes or a size such as '2GiB', got {value!r}")
    return size


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def cpu_supports_bf16() -> bool:
    """Whether this CPU computes in bf16 natively: AVX512-BF16 or AMX-BF16 (kestrel.platform's probe),
    in a torch built to use AVX-512 here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    return platform.has_bf16_instructions()


def resolve_dtype(dtype: str, device: torch.device, cpu_prefers_bf16: Callable[[], bool]) -> torch.dtype:
    """--dtype as a torch dtype. "auto": bf16 on a GPU that has it (else float16); on a CPU, bf16
    where `cpu_prefers_bf16()` says it is the faster (kestrel.ops.cpu_prefers_bf16 knows the
    kernels; this module may not import them), else float32."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_prefers_bf16() else torch.float32
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "half": torch.float16, "fp16": torch.float16, "float32": torch.float32,
             "float": torch.float32, "fp32": torch.float32}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of auto, {', '.join(names)}")
    return names[dtype]
