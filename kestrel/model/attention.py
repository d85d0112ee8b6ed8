"""Attention over the paged KV cache, for a flattened batch of mixed prefill and decode tokens.

Layout of one step's batch (the model runner guarantees it): first the decodes (requests with one
token this step), one row each, longest context first; then each prefill chunk's tokens, contiguous.
The KV cache of a layer is a pair of tensors [num_slots, num_kv_heads, head_dim],
slot = block_id * block_size + offset.

Prefill chunks are served by a compiled AMX kernel where the CPU has AMX and the model is bf16
(kestrel/ops/cpu_prefill.cpp), else by SDPA. Decodes are served by a compiled CPU kernel that reads
the paged cache in place (kestrel/ops, when it builds), else by the PyTorch path here: in groups,
one batched SDPA call per group over the members' gathered contexts (padded to the group's longest,
masked). The runner sorts decodes by length and cuts groups at a padded-size budget: on CPU one call
over a large batch runs ~4x slower than the same work split into calls whose operands stay in cache,
and sorting keeps the padding small. Each prefill chunk gets its own call: causal on its own keys
when it starts at position 0, else over its gathered context with a bottom-right causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int                       # first row of the chunk in the flattened batch
    token_end: int
    context_blocks: torch.Tensor | None    # [num_blocks] block ids of the whole context; None: no prior context
    mask: torch.Tensor | None              # [q_len, num_blocks * block_size] bool, True = may attend; None
                                           # when `prefill_kernel` serves the chunk
    context_len: int = 0                   # keys the chunk's last token sees (its position + 1)


@dataclass
class DecodeGroup:
    token_start: int                       # the group's decodes are rows [token_start, token_end)
    token_end: int
    block_table: torch.Tensor              # [n, max_blocks] block ids (0, the null block, pads)
    seq_lens: torch.Tensor                 # [n] context length of each member, this token included
    mask: torch.Tensor | None              # [n, 1, 1, max_blocks * block_size] additive, -inf past a
                                           # member's length; None when `decode_kernel` serves the group


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor             # [num_tokens] where each token's K/V is written
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # The compiled CPU decode kernel (kestrel/ops), reading the paged cache in place; None: PyTorch path.
    decode_kernel: Callable | None = None
    # The compiled AMX prefill kernel (kestrel/ops/cpu_prefill.cpp): causal attention of a chunk's
    # queries over its keys, the queries being the last ones; None: SDPA.
    prefill_kernel: Callable | None = None


# A layer's cache: (k, v) [num_slots, kv_heads, head_dim] in the model's dtype; or, with
# --kv-cache-dtype int8, (k_t, k_scale, v, v_scale): int8 rows with a float32 scale each, K transposed
# within blocks of 16 tokens (k_t [num_blocks, kv_heads, head_dim, 16], k_scale [num_blocks, kv_heads,
# 16]; v [num_slots, kv_heads, head_dim], v_scale [num_slots, kv_heads]). Kernels take it unpacked.
KVCache = tuple[torch.Tensor, ...]
INT8_BLOCK = 16


def is_int8(cache: KVCache) -> bool:
    return len(cache) == 4


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows along the last dim and their float32 scales: scale = max|x| / 127 and
    q = round-half-even(x / scale), both true divisions (a zero row: q = 0, scale = 0)."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = amax / torch.full_like(amax, 127.0)   # a tensor divisor: torch divides a scalar by reciprocal
    safe = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe.unsqueeze(-1)).to(torch.int8)
    return q, scale


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if is_int8(cache):
        k_t, k_scale, v_q, v_scale = cache
        block, offset = slot_mapping // INT8_BLOCK, slot_mapping % INT8_BLOCK
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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                    meta: AttentionMetadata, scale: float, kv_written: bool = False) -> torch.Tensor:
    """q [N, heads, head_dim], k and v [N, kv_heads, head_dim] of this step's tokens → [N, heads, head_dim].
    k and v go to the cache first, unless `kv_written` says the caller has put them there.

    With `cache` None (the memory profile run) every chunk must start at position 0."""
    if cache is not None and not kv_written:
        write_kv(cache, k, v, meta.slot_mapping)
    if not meta.prefills and len(meta.decodes) == 1 and meta.decodes[0].mask is None:
        # A decode-only step served by the kernel: its output is the whole result.
        group = meta.decodes[0]
        return meta.decode_kernel(q, *cache, group.block_table, group.seq_lens, meta.block_size, scale, True)
    out = torch.empty_like(q)
    for group in meta.decodes:
        s, e = group.token_start, group.token_end
        if group.mask is None:
            out[s:e] = meta.decode_kernel(q[s:e], *cache, group.block_table, group.seq_lens, meta.block_size, scale)
        else:
            out[s:e] = _decode_attention(q[s:e], cache, group, meta.block_size, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        if meta.prefill_kernel is not None:
            out[s:e] = _prefill_attention_kernel(meta.prefill_kernel, q[s:e], k[s:e], v[s:e], cache, chunk,
                                                 meta.block_size, scale)
        else:
            out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], cache, chunk, meta.block_size, scale)
    return out


def _decode_attention(q: torch.Tensor, cache: KVCache, group: DecodeGroup, block_size: int,
                      scale: float) -> torch.Tensor:
    n, heads, head_dim = q.shape
    k, v = gather_kv(cache, group.block_table, block_size, q.dtype)   # [n, kv_heads, len, head_dim]
    kv_heads = k.shape[1]
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become
    # that head's query rows (query head h reads KV head h // group).
    qg = q.view(n, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
    return o.reshape(n, heads, head_dim)


def _prefill_attention_kernel(kernel: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cache: KVCache | None, chunk: PrefillChunk, block_size: int,
                              scale: float) -> torch.Tensor:
    if chunk.context_blocks is not None:
        kh, vh = gather_kv(cache, chunk.context_blocks, block_size, q.dtype)  # [kv_heads, len, head_dim]
        k = kh.transpose(0, 1)[:chunk.context_len]
        v = vh.transpose(0, 1)[:chunk.context_len]
    return kernel(q, k, v, scale)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                       chunk: PrefillChunk, block_size: int, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)                  # [1, heads, q_len, head_dim]
    if chunk.context_blocks is None:
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kh, vh = gather_kv(cache, chunk.context_blocks, block_size, q.dtype)  # [kv_heads, len, head_dim]
        o = F.scaled_dot_product_attention(qh, kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=chunk.mask,
                                           scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
