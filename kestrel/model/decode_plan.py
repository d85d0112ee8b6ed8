"""The decode step of a Llama-family model with its kernels bound once: the CPU's stand-in for
replaying a captured graph.

At batch 1 a decode step of the default model is ~300 kernel calls, and the Python between them
(module calls, the dtype/shape/contiguity checks that pick a kernel, slicing, the attention
dispatch) cost ~1.9 ms of a ~13.4 ms forward pass (measured against the same kernels called
straight). Everything those checks decide is fixed for a model (dtype, shapes, AMX) or for a step
(decode-only, rows), so a plan settles it once: it holds, per layer, the kernels and weights to call,
and runs a decode-only step as a straight list of calls. For a float32 Llama-family model on the
AVX2 build (no q/k norms, no biases, the float cache) the list itself runs in C++
(`DecodeLayersF32`): the same kernels in the same order, without the Python between them (~2 ms of
a ~27 ms batch-1 step on 2 AVX2 cores).

Invariant: a step the plan covers gives bit-identical hidden states to `LlamaForCausalLM.forward`
(same kernels, same order, same roundings); tests/test_decode_plan.py holds it to that. A plan is
built for a bf16 model where the CPU has AMX (its projections on the AMX matmul), or for a float32
model on the AVX2 build of the kernels (its projections on linear_f32). Everything else (prefill
chunks, mixed steps, more rows than the bound matmul takes, no compiled kernels) runs the model's
own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel.model.attention import AttentionMetadata, KVCache, is_int8
from kestrel.model.layers import AMX_MAX_ROWS, F32_MAX_ROWS, Linear
from kestrel.model.layers import rms_norm as head_rms_norm  # kernel or PyTorch, by the input's layout
from kestrel.ops import amx_disabled, cpu_gemv, cpu_kernels, linear_f32_preferred

Projection = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BoundMatmul:
    """A projection as `matmul(x, weight)`: the plan's kernel bound to its weight."""
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    weight: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight)


@dataclass(frozen=True)
class LayerPlan:
    input_norm: torch.Tensor
    qkv_proj: Projection
    o_proj: Projection
    post_attention_norm: torch.Tensor
    gate_up_proj: Projection
    down_proj: Projection
    q_norm: torch.Tensor | None = None     # per-head norms of q and k (Qwen3), else None
    k_norm: torch.Tensor | None = None


class DecodePlan:
    def __init__(self, model: torch.nn.Module, layers: list[LayerPlan], max_rows: int) -> None:
        cfg = model.cfg
        self.max_rows = max_rows  # the most rows the bound matmul takes (linear would pick another above)
        self.embed = model.embed_tokens.weight
        self.rotary = model.rotary
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        kernels = cpu_kernels()
        self.rms_norm = kernels.rms_norm
        self.rotary_write_kv = kernels.rotary_write_kv
        self.rotary_write_kv_int8 = kernels.rotary_write_kv_int8
        self.silu_and_mul = kernels.silu_and_mul
        # The whole layer loop in one C++ call (float32 on the AVX2 build, no q/k norms or biases,
        # the float cache): built on the first step, once the KV caches exist.
        self.native_class = getattr(kernels, "DecodeLayersF32", None) if self._native_eligible(model) else None
        self._native: tuple[list[KVCache], Callable] | None = None

    def _native_eligible(self, model: torch.nn.Module) -> bool:
        return (model.cfg.dtype == torch.float32 and not model.cfg.qk_norm
                and all(isinstance(p, BoundMatmul) and p.matmul is cpu_kernels().linear_f32
                        for layer in self.layers
                        for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)))

    def native_layers(self, kv_caches: list[KVCache], attend: Callable) -> Callable | None:
        """The C++ layer loop for these caches, or None where the Python loop runs (int8 cache, or
        an attention kernel other than the float one)."""
        if (self.native_class is None or is_int8(kv_caches[0])
                or attend is not cpu_kernels().paged_decode_attention):
            return None
        if self._native is None or self._native[0] is not kv_caches:
            weights = [t for layer in self.layers for t in (
                layer.input_norm, layer.qkv_proj.weight, layer.o_proj.weight, layer.post_attention_norm,
                layer.gate_up_proj.weight, layer.down_proj.weight)]
            caches = [t for cache in kv_caches for t in cache]
            self._native = (kv_caches, self.native_class(weights, caches, self.heads, self.eps, self.scale))
        return self._native[1]

    @classmethod
    def build(cls, model: torch.nn.Module) -> DecodePlan | None:
        """A plan for `model`, or None where its decode steps need the general forward."""
        cfg = getattr(model, "cfg", None)
        # The elementwise kernels take rows of a multiple of 32 values (the model's forward falls
        # back to PyTorch elsewhere; the plan has no fallback).
        if (cfg is None or cfg.hidden_size % 32 or (2 * cfg.intermediate_size) % 32
                or next(model.parameters()).device.type != "cpu"):
            return None
        kernels = cpu_kernels()
        if kernels is None:
            return None
        if cfg.dtype == torch.bfloat16:
            gemv = cpu_gemv()
            if gemv is None or amx_disabled() or not gemv.amx_usable():
                return None
            bind, max_rows = (lambda m: _projection(m, gemv.linear_bf16_amx, torch.bfloat16, 16, 32)), AMX_MAX_ROWS
        elif cfg.dtype == torch.float32 and linear_f32_preferred():
            bind, max_rows = (lambda m: _projection(m, kernels.linear_f32, torch.float32, 1, 8)), F32_MAX_ROWS
        else:
            return None
        layers = [LayerPlan(layer.input_layernorm.weight, bind(layer.qkv_proj), bind(layer.o_proj),
                            layer.post_attention_layernorm.weight, bind(layer.gate_up_proj), bind(layer.down_proj),
                            layer.q_norm.weight if cfg.qk_norm else None,
                            layer.k_norm.weight if cfg.qk_norm else None)
                  for layer in model.layers]
        return cls(model, layers, max_rows)

    def covers(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step whose attention the compiled kernel serves in one call, of no more rows
        than the bound matmul takes."""
        return (not meta.prefills and len(meta.decodes) == 1 and meta.decodes[0].mask is None
                and meta.decode_kernel is not None and num_tokens <= self.max_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (before the final norm), as the model's forward."""
        n, heads, kv_heads, head_dim, q_size = (input_ids.shape[0], self.heads, self.kv_heads, self.head_dim,
                                                self.q_size)
        rms_norm, silu_and_mul, eps = self.rms_norm, self.silu_and_mul, self.eps
        # The cache is passed unpacked: (k, v), or the int8 cache's four tensors.
        rotary_write_kv = self.rotary_write_kv_int8 if is_int8(kv_caches[0]) else self.rotary_write_kv
        attend, scale, block_size = meta.decode_kernel, self.scale, meta.block_size
        group, slots = meta.decodes[0], meta.slot_mapping
        table, seq_lens = group.block_table, group.seq_lens
        cos, sin = self.rotary.lookup(positions)
        x = self.embed[input_ids]
        native = self.native_layers(kv_caches, attend)
        if native is not None:
            return native(x, cos, sin, slots, table, seq_lens, block_size)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            if residual is None:
                residual, h = x, rms_norm(x, None, layer.input_norm, eps)
            else:
                h = rms_norm(x, residual, layer.input_norm, eps)   # residual += x, in place
            qkv = layer.qkv_proj(h).view(n, heads + 2 * kv_heads, head_dim)
            if layer.q_norm is not None:  # as the model's forward does it (PyTorch norms over head slices)
                qkv = torch.cat((head_rms_norm(qkv[:, :heads], layer.q_norm, eps),
                                 head_rms_norm(qkv[:, heads:heads + kv_heads], layer.k_norm, eps),
                                 qkv[:, heads + kv_heads:]), dim=1)
            rotary_write_kv(qkv, cos, sin, *cache, slots, heads)
            out = attend(qkv[:, :heads], *cache, table, seq_lens, block_size, scale, True)
            h = layer.o_proj(out.view(n, q_size))
            h = rms_norm(h, residual, layer.post_attention_norm, eps)
            x = layer.down_proj(silu_and_mul(layer.gate_up_proj(h)))
        return x + residual


def _projection(module: torch.nn.Module, matmul: Callable, dtype: torch.dtype, n_multiple: int,
                k_multiple: int) -> Projection:
    """The call for one projection: `matmul` (the AMX kernel, or linear_f32 on the AVX2 build) on its
    weight where `linear` would pick it for every row count the plan covers, else the module itself
    (int8, bias, odd shapes)."""
    w = getattr(module, "weight", None)
    if (type(module) is Linear and not module.has_bias and w.dtype == dtype and w.is_contiguous()
            and w.shape[0] % n_multiple == 0 and w.shape[1] % k_multiple == 0):
        return BoundMatmul(matmul, w)
    return module
