"""The paged KV cache's layout, shared by every attention backend: allocation, the write of a step's
keys and values, and the gather of whole contexts.

A layer's cache: (k, v), each [num_slots, kv_heads, head_dim] in the model's dtype, slot =
block_id * block_size + offset; or, with --kv-cache-dtype int8, (k_t, k_scale, v, v_scale): int8 rows
with a float32 scale each, K transposed within blocks of INT8_KV_BLOCK tokens (k_t [num_blocks,
kv_heads, head_dim, 16], k_scale [num_blocks, kv_heads, 16]; v [num_slots, kv_heads, head_dim],
v_scale [num_slots, kv_heads]). Kernels take it unpacked. Block 0 is the null block: decode block
tables are padded with it.
"""

from __future__ import annotations

import torch

from kestrel.config import INT8_KV_BLOCK
from kestrel.ops import huge_pages

KVCache = tuple[torch.Tensor, ...]


def is_int8(cache: KVCache) -> bool:
    return len(cache) == 4


def new_kv_caches(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, int8: bool, device: torch.device) -> list[KVCache]:
    """One zeroed cache per layer, in the layout above. Zeros matter: masked padding slots must not
    hold NaN. On a CPU all layers are one lazily mapped allocation, so that a large KV pool costs RAM
    only as it fills, in huge pages where the kernel grants them (decode attention streams it)."""
    slots = num_blocks * block_size
    if int8:
        layer = [((num_blocks, kv_heads, head_dim, block_size), torch.int8),
                 ((num_blocks, kv_heads, block_size), torch.float32),
                 ((slots, kv_heads, head_dim), torch.int8), ((slots, kv_heads), torch.float32)]
    else:
        layer = [((slots, kv_heads, head_dim), dtype)] * 2
    specs = layer * num_layers
    if device.type == "cpu":
        tensors = huge_pages.zeroed(specs)
    else:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    per_layer = len(layer)
    return [tuple(tensors[i:i + per_layer]) for i in range(0, len(tensors), per_layer)]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows along the last dim and their float32 scales: scale = max|x| / 127 and
    q = round-half-even(x / scale), both true divisions (a zero row: q = 0, scale = 0)."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = amax / torch.full_like(amax, 127.0)   # a tensor divisor: torch divides a scalar by reciprocal
    safe = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).to(torch.int8)
    return q, scale


def write_qkv(cache: KVCache, qkv: torch.Tensor, num_heads: int, slot_mapping: torch.Tensor) -> None:
    """The K and V parts of a fused qkv [tokens, heads + 2 * kv_heads, head_dim] into their slots."""
    kv_heads = (qkv.shape[1] - num_heads) // 2
    write_kv(cache, qkv[:, num_heads:num_heads + kv_heads], qkv[:, num_heads + kv_heads:], slot_mapping)


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k and v [tokens, kv_heads, head_dim] into their slots (quantized for the int8 cache)."""
    if is_int8(cache):
        k_t, k_scale, v_q, v_scale = cache
        block, offset = slot_mapping // INT8_KV_BLOCK, slot_mapping % INT8_KV_BLOCK
        qk, sk = quantize_rows(k)
        k_t[block, :, :, offset] = qk
        k_scale[block, :, offset] = sk
        qv, sv = quantize_rows(v)
        v_q[slot_mapping] = qv
        v_scale[slot_mapping] = sv
        return
    k_cache, v_cache = cache
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def gather_kv(cache: KVCache, block_ids: torch.Tensor, block_size: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts as [..., kv_heads, num_blocks * block_size, head_dim] for block ids [..., num_blocks]
    (an int8 cache dequantized to `dtype`). Copying whole blocks is ~10x faster on CPU than copying the
    same bytes slot by slot."""
    if is_int8(cache):
        return _gather_int8(cache, block_ids, dtype or torch.float32)
    k_cache, v_cache = cache
    kv_heads, head_dim = k_cache.shape[1:]
    shape = (*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim)
    flat = block_ids.reshape(-1)
    k = k_cache.view(-1, block_size * kv_heads * head_dim).index_select(0, flat).view(shape).transpose(-3, -2)
    v = v_cache.view(-1, block_size * kv_heads * head_dim).index_select(0, flat).view(shape).transpose(-3, -2)
    return k, v


def _gather_int8(cache: KVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k_t, k_scale, v_q, v_scale = cache
    _, kv_heads, head_dim, bs = k_t.shape
    lead = block_ids.shape[:-1]
    length = block_ids.shape[-1] * bs
    k = k_t[block_ids].float() * k_scale[block_ids].unsqueeze(-2)          # [..., nb, kvh, D, bs]
    k = k.movedim(-1, -3).reshape(*lead, length, kv_heads, head_dim)          # [..., nb*bs, kvh, D]
    v = (v_q.view(-1, bs, kv_heads, head_dim)[block_ids].float()
         * v_scale.view(-1, bs, kv_heads)[block_ids].unsqueeze(-1)).reshape(*lead, length, kv_heads, head_dim)
    return k.to(dtype).transpose(-3, -2), v.to(dtype).transpose(-3, -2)
