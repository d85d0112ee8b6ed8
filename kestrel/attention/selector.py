"""The one place that chooses the attention backend, once per worker (vLLM's attention selector).

`--attention-backend` (EngineConfig.attention_backend):
- "cpu": the compiled CPU kernels (kestrel/attention/cpu.py). Needs a CPU device, a float32 or bf16
  model, a build of the kernels (AVX-512 or AVX2 + FMA, a C++ compiler, KESTREL_DISABLE_CPU_KERNELS
  unset) and a decode kernel for the model's (head_dim, query heads per KV head).
- "torch": the PyTorch reference (kestrel/attention/torch_sdpa.py), on any device.
- "auto": "cpu" where it can serve the model, else "torch". There is no GPU backend yet: on CUDA,
  "auto" runs the PyTorch reference (SDPA over gathered contexts); a GPU backend slots in here.
A backend asked for by name that cannot serve the configuration is a ValueError at start-up.
"""

from __future__ import annotations

import torch

from kestrel.attention.backend import AttentionBackend
from kestrel.attention.cpu import CpuKernelsBackend
from kestrel.attention.torch_sdpa import TorchSDPABackend
from kestrel.config import ATTENTION_BACKENDS, EngineConfig
from kestrel.ops import amx_disabled, cpu_kernels, cpu_prefill, prefill_attention_preferred
from kestrel.ops.dispatch import rotary_kernel_serves, select_rotary


def select_attention_backend(config: EngineConfig) -> AttentionBackend:
    name = config.attention_backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not known; choose one of {', '.join(ATTENTION_BACKENDS)}")
    device, dtype = config.device.device, config.model.dtype
    if name in ("auto", "cpu"):
        why_not = cpu_backend_unavailable(config)
        if why_not is None:
            return _cpu_backend(config)
        if name == "cpu":
            raise ValueError(f"attention backend 'cpu' cannot serve this configuration: {why_not}; "
                             f"use --attention-backend torch or auto")
    return TorchSDPABackend(dtype, select_rotary(device, dtype, config.model.head_dim, config.model.rotary_dim))


def cpu_backend_unavailable(config: EngineConfig) -> str | None:
    """Why the CPU kernels backend cannot serve this configuration, or None if it can."""
    m = config.model
    if config.device.device.type != "cpu":
        return f"the device is {config.device.device.type}, not cpu"
    if m.dtype not in (torch.float32, torch.bfloat16):
        return f"the model's dtype is {m.dtype}; the kernels take float32 and bfloat16"
    kernels = cpu_kernels()
    if kernels is None:
        return ("the compiled CPU kernels are unavailable (no AVX-512 or AVX2, no C++ compiler, or "
                "KESTREL_DISABLE_CPU_KERNELS=1)")
    if not kernels.supports(m.head_dim, m.num_heads // m.num_kv_heads):
        return (f"the decode kernel has no variant for head_dim {m.head_dim} with "
                f"{m.num_heads // m.num_kv_heads} query heads per KV head")
    return None


def _cpu_backend(config: EngineConfig) -> CpuKernelsBackend:
    m = config.model
    return CpuKernelsBackend(cpu_kernels(), _prefill_kernel(config), config.cache.kv_cache_dtype == "int8",
                             select_rotary(config.device.device, m.dtype, m.head_dim, m.rotary_dim),
                             fused_rotary=rotary_kernel_serves(m.dtype, m.head_dim, m.rotary_dim))


def _prefill_kernel(config: EngineConfig):
    """The prefill-attention kernel that serves the model, if one does: cpu_prefill's for bf16 with
    head_dim a multiple of 32 up to 256 (on AMX tiles where usable and not disabled, else by
    AVX512-BF16 dot products), else cpu_kernels' prefill_attention (float32 or bf16, head_dim a
    multiple of 16) where it is preferred over SDPA; None where chunks take SDPA."""
    m = config.model
    kernels = cpu_prefill() if m.dtype == torch.bfloat16 and m.head_dim % 32 == 0 and m.head_dim <= 256 else None
    if kernels is not None:
        if kernels.amx_usable() and not amx_disabled():
            return kernels.prefill_attention_amx
        return kernels.prefill_attention_avx512
    if prefill_attention_preferred() and m.head_dim % 16 == 0:
        return cpu_kernels().prefill_attention
    return None
