"""The decode step of a Llama-family model with its kernels bound once: the CPU's stand-in for
replaying a captured graph.

At batch 1 a decode step of the default model is ~300 kernel calls, and the Python between them
(module calls, the dtype/shape/contiguity checks that pick a kernel, slicing, the attention
dispatch) cost ~1.9 ms of a ~13.4 ms forward pass (measured against the same kernels called
straight). Everything those checks decide is fixed for a model (dtype, shapes, AMX) or for a step
(decode-only, rows), so a plan settles it once: it holds, per layer, the kernels and weights to call,
and runs a decode-only step as a straight list of calls. For a Llama-family model (no q/k norms, no
biases, the model-dtype cache) whose every projection is on the plan's matmul, the list itself runs
in C++ (cpu_kernels' `DecodeLayers`, calling the matmul by its address): the same kernels in the
same order, without the Python between them (~2 ms of a ~27 ms batch-1 step on 2 AVX2 cores in
float32, ~0.3 ms of ~11.5 ms on 2 Zen 4 cores in bf16). On the AVX512-BF16 matmul, at 1..15 rows, it
also runs each layer in three OpenMP regions instead of ~6, every thread computing its share of each
projection (the matmul's `matmul_slice_address`): ~0.1-0.5 ms less of a ~12 ms batch-1 step there.

The plan takes its kernels from the selections made once for the model: the op families'
(`model.ops.plan_kernels`: the norm and activation kernels and the matmul its projections bind) and the
attention backend's (`decode_step_kernels`: the fused rotary + KV write and decode attention, for the
float or the int8 cache). Where either has none (no compiled kernels, a bf16 model without AMX, a
float32 model on a build without linear_f32, the PyTorch attention backend) there is no plan, and
every step runs the model's own forward; so does every step under --enforce-eager.

Invariant: a step the plan covers gives bit-identical hidden states to `LlamaForCausalLM.forward`
(same kernels, same order, same roundings); tests/test_decode_plan.py holds it to that. The plan
covers decode-only steps of no more rows than its bound matmul takes; everything else (prefill
chunks, mixed steps, more rows) runs the model's forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel.attention import AttentionBackend, CommonAttentionMetadata, DecodeStepKernels, KVCache
from kestrel.model.layers import Linear
from kestrel.model.quantization import GGUFLinear
from kestrel.ops.dispatch import PlanKernels, PlanMatmul, rms_norm_reference

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
    window: int | None = None              # the layer's sliding window, None for full attention


class DecodePlan:
    def __init__(self, model: torch.nn.Module, layers: list[LayerPlan], kernels: PlanKernels,
                 step: DecodeStepKernels) -> None:
        cfg = model.cfg
        self.max_rows = kernels.matmul.max_rows  # the most rows the bound matmul takes
        self.embed_rows = model.embed_tokens.rows
        self.rotary = model.rotary
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.rms_norm = kernels.rms_norm
        self.head_rms_norm = rms_norm_reference   # the q/k norms, as the forward runs them (DecoderLayer.head_rms_norm)
        self.silu_and_mul = kernels.silu_and_mul
        self.rotary_write_kv = step.rotary_write_kv
        self.decode_attention = step.decode_attention
        # The whole layer loop in one C++ call (no q/k norms, every projection bound to a matmul with an
        # address, the model-dtype cache): built on the first step, once the KV caches exist.
        self.matmul_address = kernels.matmul.address
        self.slice_address = kernels.matmul.slice_address or 0
        self.packed_slice_address = kernels.matmul.packed_slice_address or 0
        self.native_class = kernels.layer_loop if self._native_eligible(model, kernels.matmul, step) else None
        self._native: tuple[list[KVCache], Callable] | None = None

    def _native_eligible(self, model: torch.nn.Module, matmul: PlanMatmul, step: DecodeStepKernels) -> bool:
        projections = [p for layer in self.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                            layer.down_proj)]
        return (matmul.address is not None and not model.cfg.qk_norm and not step.kv_int8
                and all(layer.window is None for layer in self.layers)
                and all(isinstance(p, BoundMatmul) and p.matmul is matmul.kernel for p in projections)
                and len({p.weight.dim() for p in projections}) <= 1)   # all packed, or none

    def native_layers(self, kv_caches: list[KVCache]) -> Callable | None:
        """The C++ layer loop for these caches, or None where the Python loop runs."""
        if self.native_class is None:
            return None
        if self._native is None or self._native[0] is not kv_caches:
            weights = [t for layer in self.layers for t in (
                layer.input_norm, layer.qkv_proj.weight, layer.o_proj.weight, layer.post_attention_norm,
                layer.gate_up_proj.weight, layer.down_proj.weight)]
            caches = [t for cache in kv_caches for t in cache]
            packed = weights[1].dim() == 3   # every projection, then (_native_eligible)
            self._native = (kv_caches, self.native_class(weights, caches, self.heads, self.eps, self.scale,
                                                         self.matmul_address,
                                                         self.packed_slice_address if packed else self.slice_address))
        return self._native[1]

    @classmethod
    def build(cls, model: torch.nn.Module, attn: AttentionBackend) -> DecodePlan | None:
        """A plan for `model` on `attn`, or None where its decode steps need the general forward. A
        sharded model (tensor or pipeline parallel) has no plan: the plan has no collectives and runs
        every layer from the embedding to the final hidden states."""
        shard = getattr(model, "shard", None)
        if shard is not None and shard.is_sharded:
            return None
        if not getattr(model, "has_llama_layers", False):
            return None
        cfg = getattr(model, "cfg", None)
        ops = getattr(model, "ops", None)
        # The elementwise kernels take rows of a multiple of 32 values (the model's forward falls
        # back to PyTorch elsewhere; the plan has no fallback).
        if cfg is None or ops is None or cfg.hidden_size % 32 or (2 * cfg.intermediate_size) % 32:
            return None
        kernels, step = ops.plan_kernels, attn.decode_step_kernels()
        if kernels is None or step is None:
            return None
        if (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
                cfg.query_pre_attn_scalar) != (1.0, 1.0, None, None):
            return None   # the plan runs Llama's arithmetic: no multipliers, scale 1/sqrt(head_dim)
        if cfg.rotary_dim != cfg.head_dim:
            return None   # its fused rotary kernel rotates whole heads
        windowed = any(layer.window is not None for layer in model.layers)
        if model.local_rotary is not None or (windowed and step.kv_int8):
            return None   # one rope for every layer; the int8 decode kernel takes no window
        matmul = _layers_matmul(model, kernels.matmul)
        kernels = dataclasses.replace(kernels, matmul=matmul)
        layers = [LayerPlan(layer.input_layernorm.weight, _projection(layer.qkv_proj, matmul),
                            _projection(layer.o_proj, matmul), layer.post_attention_layernorm.weight,
                            _projection(layer.gate_up_proj, matmul), _projection(layer.down_proj, matmul),
                            layer.q_norm.weight if cfg.qk_norm else None,
                            layer.k_norm.weight if cfg.qk_norm else None, layer.window)
                  for layer in model.layers]
        return cls(model, layers, kernels, step)

    def covers(self, batch: CommonAttentionMetadata) -> bool:
        """A decode-only step of no more rows than the bound matmul takes."""
        return not batch.prefills and batch.num_decodes <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 batch: CommonAttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (before the final norm), as the model's forward."""
        n, heads, kv_heads, head_dim, q_size = (input_ids.shape[0], self.heads, self.kv_heads, self.head_dim,
                                                self.q_size)
        rms_norm, silu_and_mul, eps = self.rms_norm, self.silu_and_mul, self.eps
        # The cache is passed unpacked: (k, v), or the int8 cache's four tensors.
        rotary_write_kv, attend, scale = self.rotary_write_kv, self.decode_attention, self.scale
        slots, block_size = batch.slot_mapping, batch.block_size
        table, seq_lens = batch.decode_block_table, batch.decode_seq_lens
        cos, sin = self.rotary.lookup(positions)
        x = self.embed_rows(input_ids)
        native = self.native_layers(kv_caches)
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
                qkv = torch.cat((self.head_rms_norm(qkv[:, :heads], layer.q_norm, eps),
                                 self.head_rms_norm(qkv[:, heads:heads + kv_heads], layer.k_norm, eps),
                                 qkv[:, heads + kv_heads:]), dim=1)
            rotary_write_kv(qkv, cos, sin, *cache, slots, heads)
            out = attend(qkv[:, :heads], *cache, table, seq_lens, block_size, scale, True,
                         *(() if layer.window is None else (layer.window,)))
            h = layer.o_proj(out.view(n, q_size))
            h = rms_norm(h, residual, layer.post_attention_norm, eps)
            x = layer.down_proj(silu_and_mul(layer.gate_up_proj(h)))
        return x + residual


def _layers_matmul(model: torch.nn.Module, matmul: PlanMatmul) -> PlanMatmul:
    """The matmul the plan binds: the model's linear op's, or linear_gguf where every projection holds
    a GGUF file's blocks (GGUFLinear; the C++ layer loop then runs on them too)."""
    projections = [p for layer in model.layers for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                         layer.down_proj)]
    if projections and all(type(p) is GGUFLinear for p in projections):
        return projections[0].plan_matmul
    return matmul


def _projection(module: torch.nn.Module, matmul: PlanMatmul) -> Projection:
    """The call for one projection: the plan's matmul on its weight where the model's linear op would
    pick it for every row count the plan covers, else the module itself (int8, bias, odd shapes)."""
    w = getattr(module, "weight", None)
    if type(module) is GGUFLinear and not module.has_bias and module.plan_matmul is matmul:
        return BoundMatmul(matmul.kernel, w)   # packed: its shapes were checked when it was kept
    if (type(module) is Linear and not module.has_bias and w.dtype == matmul.dtype and w.is_contiguous()
            and w.shape[0] % matmul.n_multiple == 0 and w.shape[1] % matmul.k_multiple == 0):
        return BoundMatmul(matmul.kernel, w)
    return module
