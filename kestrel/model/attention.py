"""Attention over the paged KV cache, for a flattened batch of mixed prefill and decode tokens.

Layout of one step's batch (the model runner guarantees it): the first `num_decodes` tokens are
one query token each of `num_decodes` requests ("decodes": any request with one token this step);
then each prefill chunk's tokens, contiguous. The KV cache of a layer is a pair of tensors
[num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset.

Decodes are served by one batched SDPA call over their gathered contexts (padded to the longest,
masked); each prefill chunk gets its own call: causal on its own keys when it starts at position 0,
else over its gathered context with a bottom-right causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int                       # first row of the chunk in the flattened batch
    token_end: int
    context_slots: torch.Tensor | None     # [seq_len] slots of the whole context; None: no prior context
    mask: torch.Tensor | None              # [q_len, seq_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor             # [num_tokens] where each token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None      # [num_decodes, max_len] slots of each decode's context
    decode_mask: torch.Tensor | None       # [num_decodes, 1, 1, max_len] bool
    prefills: list[PrefillChunk]


KVCache = tuple[torch.Tensor, torch.Tensor]


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    k_cache, v_cache = cache
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def gather_kv(cache: KVCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts as [..., kv_heads, len, head_dim] for the slots' shape [..., len]."""
    k_cache, v_cache = cache
    shape = (*slots.shape, *k_cache.shape[1:])
    flat = slots.reshape(-1)
    k = k_cache.index_select(0, flat).view(shape).transpose(-3, -2)
    v = v_cache.index_select(0, flat).view(shape).transpose(-3, -2)
    return k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [N, heads, head_dim], k and v [N, kv_heads, head_dim] of this step's tokens → [N, heads, head_dim].

    With `cache` None (the memory profile run) every chunk must start at position 0."""
    if cache is not None:
        write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    n_dec = meta.num_decodes
    if n_dec:
        out[:n_dec] = _decode_attention(q[:n_dec], cache, meta, scale)
    for chunk in meta.prefills:
        s, e = chunk.token_start, chunk.token_end
        out[s:e] = _prefill_attention(q[s:e], k[s:e], v[s:e], cache, chunk, scale)
    return out


def _decode_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    n, heads, head_dim = q.shape
    k, v = gather_kv(cache, meta.decode_slots)           # [n, kv_heads, len, head_dim]
    kv_heads = k.shape[1]
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become
    # that head's query rows (query head h reads KV head h // group).
    qg = q.view(n, kv_heads, heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(n, heads, head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                       chunk: PrefillChunk, scale: float) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)                  # [1, heads, q_len, head_dim]
    if chunk.context_slots is None:
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        kh, vh = gather_kv(cache, chunk.context_slots)  # [kv_heads, seq_len, head_dim]
        o = F.scaled_dot_product_attention(qh, kh.unsqueeze(0), vh.unsqueeze(0), attn_mask=chunk.mask,
                                           scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
