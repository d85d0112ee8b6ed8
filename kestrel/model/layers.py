"""Building blocks shared by the decoder models: RMSNorm (with the residual add fused), SiLU-and-mul
and rotary position embeddings.

On CPUs with AVX-512 the norm and the activation run as compiled kernels (kestrel/ops); the PyTorch
code here is their reference and the path everywhere else. Both follow Hugging Face's arithmetic
(norms and activations in float32, rotary with `rotate_half`), so float32 runs match `transformers`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.model.attention import is_int8
from kestrel.ops import amx_disabled, cpu_gemv, cpu_kernels, linear_f32_preferred


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _kernel_for(x: torch.Tensor):
    """The compiled CPU kernels if they can take `x` (2-D, contiguous, float32/bf16, 16-aligned)."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[-1] % 32 == 0 and x.is_contiguous()):
        return cpu_kernels()
    return None


# Up to this many rows a bf16 linear layer streams its weights through the AMX kernel (cpu_gemv.cpp),
# 1.2-2x torch's GEMM at every size from 1 to 128 rows on this machine; prefill chunks above it go
# to torch's GEMM, which reaches the AMX rate there.
AMX_MAX_ROWS = 128
# Without AMX (AVX512-BF16 only): the small-batch kernel up to this many rows, four only for layers
# narrower than SMALL_BATCH_MAX_OUT_AT_4 (the output head's many rows favour the GEMM from two up).
SMALL_BATCH_ROWS = 4
SMALL_BATCH_MAX_OUT_AT_4 = 8192


# Float32 on AVX2 machines (no bf16 there): the small-batch kernel (linear_f32, cpu_kernels_avx2.cpp) up
# to this many rows. Over the default model's weights as a decode step reads them (538 MB, from
# memory), torch's GEMM takes 1.6-3.6x its time at 1-16 rows and 1.04-1.3x at 64-128 (BENCHMARKS.md);
# prefill chunks beyond it go to torch's GEMM, which reaches ~140 GFLOP/s there.
F32_MAX_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the small-batch bf16 or float32 kernels where they are faster (decode)."""
    kernels = _small_batch_kernels(x, weight, bias)
    if kernels is not None:
        if weight.shape[0] % 16 == 0 and _amx_usable(kernels):
            return kernels.linear_bf16_amx(x, weight)
        if x.shape[0] <= SMALL_BATCH_ROWS and (x.shape[0] <= 2 or weight.shape[0] <= SMALL_BATCH_MAX_OUT_AT_4):
            return kernels.linear_bf16_small(x, weight)
    elif (f32 := _f32_kernels(x, weight)) is not None:
        y = f32.linear_f32(x, weight)
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """A projection of a decoder layer: nn.Linear's parameters, forward through `linear` (the small-batch
    kernels). --quantization replaces it (kestrel/model/quantization.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.has_bias = bias  # a plain attribute: reading `self.bias` goes through nn.Module.__getattr__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias if self.has_bias else None)

    # Called straight, without nn.Module's hook machinery. Each µs here is 120 µs of a decode step of
    # the default model (measured: the module call and the bias lookup cost ~3.5 µs a call, ~2% of a
    # batch-1 step). Kestrel registers no hooks on these modules.
    __call__ = forward


def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(x, weight).float(), in one pass where the AMX kernel runs (the output head: it writes
    the bf16-rounded logits as float32 instead of a bf16 tensor to widen afterwards)."""
    kernels = _small_batch_kernels(x, weight, None)
    if kernels is not None and weight.shape[0] % 16 == 0 and _amx_usable(kernels):
        return kernels.linear_bf16_amx(x, weight, float_out=True)
    return linear(x, weight).float()


def _small_batch_kernels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The small-batch kernels (cpu_gemv.cpp) if this product is theirs to take: bf16 on CPU,
    1..AMX_MAX_ROWS rows, K a multiple of 32, no bias; else None."""
    if (bias is None and x.dim() == 2 and 1 <= x.shape[0] <= AMX_MAX_ROWS and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and x.shape[1] % 32 == 0 and weight.dtype == torch.bfloat16
            and weight.is_contiguous()):
        return cpu_gemv()
    return None


def _f32_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The AVX2 kernels (linear_f32) if this float32 product is theirs to take, else None."""
    if (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and weight.dtype == torch.float32
            and 1 <= x.shape[0] <= F32_MAX_ROWS
            and x.shape[1] % 8 == 0 and weight.is_contiguous()):
        if linear_f32_preferred():
            return cpu_kernels()
    return None


@functools.cache
def _amx_usable(kernels) -> bool:
    return not amx_disabled() and kernels.amx_usable()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernels = _kernel_for(x)
    if kernels is not None:
        return kernels.rms_norm(x, None, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x). The kernel updates `residual` in place: the caller
    owns the residual stream."""
    kernels = _kernel_for(x)
    if kernels is not None and residual.is_contiguous():
        return kernels.rms_norm(x, residual, weight, eps), residual
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, round to the input dtype, then scale (Hugging Face's order)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate | up along the last dim → silu(gate) * up."""
    kernels = _kernel_for(x)
    if kernels is not None:
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the rope types we support."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for every position up to `max_positions`, looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for a step's tokens, [tokens, 1, head_dim]; looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_and_write_kv(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                        cache: tuple[torch.Tensor, ...] | None, slot_mapping: torch.Tensor) -> bool:
    """Rotate the q and k heads of qkv [tokens, num_heads + 2 kv_heads, head_dim] in place. Where
    the CPU kernel runs, it also writes k and v to `cache` (bf16/float32, or int8: see
    kestrel/model/attention.py) in the same pass; returns whether it did (if not, the caller writes them)."""
    num_kv_heads = (qkv.shape[1] - num_heads) // 2
    if (qkv.device.type == "cpu" and qkv.dtype in (torch.float32, torch.bfloat16) and qkv.is_contiguous()
            and qkv.shape[-1] % 32 == 0 and cos.dtype == qkv.dtype):
        kernels = cpu_kernels()
        if kernels is not None:
            if cache is None:
                kernels.rotary_write_kv(qkv, cos, sin, qkv, qkv, None, num_heads)  # caches unused
                return False
            if not is_int8(cache):
                kernels.rotary_write_kv(qkv, cos, sin, cache[0], cache[1], slot_mapping, num_heads)
                return True
            if hasattr(kernels, "rotary_write_kv_int8"):  # the AVX2 build has none: PyTorch below
                kernels.rotary_write_kv_int8(qkv, cos, sin, *cache, slot_mapping, num_heads)
                return True
    qk = qkv[:, :num_heads + num_kv_heads]
    qk.copy_(apply_rotary(qk, cos, sin))
    return False


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] (Hugging Face's rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
