"""The machine's limits, measured in the same run as a benchmark (see bench/WORKLOADS.md).

    measure_limits(shapes)      -> MachineLimits: matmul GFLOP/s (bf16, fp32) at the model's layer
                                   shapes, and the memory copy rate
    model_param_counts(config)  -> ParamCounts: the parameters a token runs through
    workload_flops(...)         -> the FLOPs W1 defines: prompt tokens x 2 x non-embedding params
                                   + output tokens x 2 x all params (output head included)
    decode_bytes(...)           -> the bytes W1's decode steps must read at the least: every weight
                                   once per step, every cached K and V row once per output token

A workload's achieved GFLOP/s over the matmul rate in the model's dtype (bf16, or float32 where the
model runs in float32: roofline_dtype) is the fraction of the roofline it reaches (the issue's
figure); attention's own FLOPs are left out on purpose (WORKLOADS.md: "attention extra"), so the
fraction is a little pessimistic for long contexts.

That figure counts compute only. Decode is bound by memory instead: a step reads every weight for a
handful of rows, and each output token reads its whole context's K and V. So the report also gives
the memory floor (decode_bytes at the streaming read rate measured in the same run) and the
roofline proper, max(compute time, memory time): no engine that reads what it must from memory can
run the workload faster than that.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

# Rows of the activations in one matmul: a prefill-sized batch, as in WORKLOADS.md's example.
MATMUL_ROWS = 1024
COPY_BYTES = 256 << 20
# Past the last-level cache (up to 480 MiB seen on these machines), so that it times memory.
READ_BYTES = 1 << 30
REPEATS = 5


@dataclass(frozen=True)
class ParamCounts:
    non_embedding: int   # the decoder layers and the final norm
    output_head: int     # the vocabulary projection (counted even when tied to the embeddings)

    @property
    def per_output_token(self) -> int:
        return self.non_embedding + self.output_head


@dataclass(frozen=True)
class MachineLimits:
    bf16_gflops: float          # FLOP-weighted over the layer's matmul shapes
    fp32_gflops: float
    copy_gb_s: float            # bytes copied per second (each byte is read once and written once)
    read_gb_s: float            # bytes read per second by a streaming sum over READ_BYTES
    shapes: list[tuple[int, int]]  # (out_features, in_features) of the matmuls timed
    per_shape_bf16_gflops: list[float]
    threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_param_counts(hf_config: Any) -> ParamCounts:
    """From a Hugging Face config of a Llama-family model (Llama, Mistral, Qwen3)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim   # q, k, v
                 + heads * head_dim * hidden                   # o
                 + 3 * hidden * inter                          # gate, up, down
                 + 2 * hidden)                                 # the two norms
    if getattr(hf_config, "model_type", "") == "qwen3":
        per_layer += 2 * head_dim                              # q_norm, k_norm
    non_embedding = hf_config.num_hidden_layers * per_layer + hidden
    return ParamCounts(non_embedding=non_embedding, output_head=hf_config.vocab_size * hidden)


def layer_shapes(hf_config: Any) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's matmuls as Kestrel runs them (fused qkv
    and gate_up)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
            (2 * inter, hidden), (hidden, inter)]


def workload_flops(prompt_tokens: int, output_tokens: int, params: ParamCounts) -> float:
    return 2.0 * (prompt_tokens * params.non_embedding + output_tokens * params.per_output_token)


def kv_bytes_per_token(hf_config: Any, kv_cache_dtype: str, model_dtype_bytes: int) -> int:
    """The K and V one token leaves in the cache, all layers: in the model's dtype, or (int8 cache)
    one byte a value plus a float32 scale per (token, KV head)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    per_head = head_dim + 4 if kv_cache_dtype == "int8" else head_dim * model_dtype_bytes
    return hf_config.num_hidden_layers * 2 * kv_heads * per_head


def decode_bytes(input_lens: list[int], output_lens: list[int], weight_bytes: int, kv_token_bytes: int) -> float:
    """A lower bound on what the decode steps read from memory. A request's output tokens after the
    first take one step each, so there are at least max(output) - 1 decode steps, and each reads
    every weight (weight_bytes, the output head included); the step that makes a request's output
    token j (j = 1 .. output - 1; token 0 comes from prefill) attends over its input + j positions.
    Prefill, whose products reuse each weight for many rows, is left to the compute side. (For
    decoding one token a step: speculative decoding would need fewer steps.)"""
    steps = max(output_lens, default=1) - 1
    kv_rows = sum((o - 1) * i + (o - 1) * o // 2 for i, o in zip(input_lens, output_lens))
    return float(steps) * weight_bytes + float(kv_rows) * kv_token_bytes


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(shapes: list[tuple[int, int]], dtype: Any, rows: int = MATMUL_ROWS) -> list[float]:
    """GFLOP/s of F.linear([rows, in] x [out, in]^T) per shape, each the median of a few calls of
    enough back-to-back matmuls to last ~50 ms."""
    import torch
    import torch.nn.functional as F

    rates = []
    for out_f, in_f in shapes:
        x = torch.randn(rows, in_f).to(dtype)
        w = torch.randn(out_f, in_f).to(dtype)
        flops = 2.0 * rows * in_f * out_f
        once = _median_seconds(lambda x=x, w=w: F.linear(x, w), repeats=3)
        reps = max(1, int(0.05 / max(once, 1e-6)))

        def many(x: torch.Tensor = x, w: torch.Tensor = w, reps: int = reps) -> None:
            for _ in range(reps):
                F.linear(x, w)

        rates.append(flops * reps / _median_seconds(many) / 1e9)
    return rates


def copy_gb_s(nbytes: int = COPY_BYTES) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return nbytes / _median_seconds(lambda: dst.copy_(src)) / 1e9


def read_gb_s(nbytes: int = READ_BYTES) -> float:
    """The streaming read rate: a sum over nbytes of float32 (read once, nothing written)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _median_seconds(lambda: src.sum()) / 1e9


def flop_weighted(rates: list[float], shapes: list[tuple[int, int]]) -> float:
    """The rate of running every shape once: total FLOPs over total time."""
    flops = [o * i for o, i in shapes]
    return sum(flops) / sum(f / r for f, r in zip(flops, rates))


def roofline_dtype(model_dtype: str, native_bf16: bool | None = None) -> str:
    """The matmul rate a model's runs are set against: bfloat16 for a bf16 model on a CPU with bf16
    instructions (`native_bf16`, default: this CPU's), else float32. Without them a bf16 model's products
    run as float32 FMAs on widened weights (cpu_kernels' linear_bf16), and torch's emulated bf16 GEMM
    (~17 GFLOP/s on 2 Zen 3 cores, against ~130 in float32) is no limit of the machine."""
    if native_bf16 is None:
        from kestrel.config import cpu_supports_bf16
        native_bf16 = cpu_supports_bf16()
    return "bfloat16" if model_dtype == "bfloat16" and native_bf16 else "float32"


def gflops_of(shapes: list[tuple[int, int]], dtype: str) -> float:
    """The matmul rate alone in `dtype` (≈ 1 s), to pair with each timed run of a workload."""
    import torch

    return flop_weighted(matmul_gflops(shapes, getattr(torch, dtype)), shapes)


def measure_limits(shapes: list[tuple[int, int]]) -> MachineLimits:
    import torch

    bf16 = matmul_gflops(shapes, torch.bfloat16)
    fp32 = matmul_gflops(shapes, torch.float32)
    return MachineLimits(bf16_gflops=flop_weighted(bf16, shapes), fp32_gflops=flop_weighted(fp32, shapes),
                         copy_gb_s=copy_gb_s(), read_gb_s=read_gb_s(), shapes=list(shapes),
                         per_shape_bf16_gflops=bf16,
                         threads=torch.get_num_threads())
