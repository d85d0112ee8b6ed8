"""The PyTorch reference backend: any device, gather + SDPA over the paged cache.

Decodes run in groups, one batched SDPA call per group over the members' gathered contexts (padded to
the group's longest, masked). The batch's decodes come longest first and are cut into groups at a
padded-size budget: on CPU one call over a large batch runs ~4x slower than the same work split into
calls whose operands stay in cache, and the order keeps the padding small. Each prefill chunk gets
its own call: causal on its own keys when it starts at position 0, else over its gathered context
with a bottom-right causal mask.

A sliding-window layer (Mistral, Gemma's local layers) passes its window W to `forward`: a token at
position p then sees keys p - W + 1 .. p only (Hugging Face's window). Its masks are built on the
first such layer of a step and shared by the others with the same window. A layer with a soft cap
(Gemma 2) passes it too: its scores s become cap * tanh(s / cap) before the mask and the softmax,
which SDPA does not do, so such layers compute attention in plain operations (`capped_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from kestrel.attention.backend import AttentionBackend, CommonAttentionMetadata, PrefillSpan
from kestrel.attention.kv_cache import KVCache, gather_kv, write_qkv
from kestrel.ops.dispatch import Rotary

# Padded context slots per decode attention call.
DECODE_GROUP_SLOTS = 2048


@dataclass
class PrefillChunk:
    token_start: int                       # first row of the chunk in the flattened batch
    token_end: int
    context_blocks: torch.Tensor | None    # [num_blocks] block ids of the whole context; None: no prior context
    mask: torch.Tensor | None              # [q_len, num_blocks * block_size] bool, True = may attend; None
                                           # where a kernel serves the chunk, or without context
    context_len: int = 0                   # keys the chunk's last token sees (its position + 1)


@dataclass
class DecodeGroup:
    token_start: int                       # the group's decodes are rows [token_start, token_end)
    token_end: int
    block_table: torch.Tensor              # [n, max_blocks] block ids (0, the null block, pads)
    seq_lens: torch.Tensor                 # [n] context length of each member, this token included
    mask: torch.Tensor                     # [n, 1, 1, max_blocks * block_size] additive, -inf past a
                                           # member's length


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    common: CommonAttentionMetadata | None = None
    # window -> that window's (decodes, prefills), built on first use in the step
    windowed: dict[int, tuple[list[DecodeGroup], list[PrefillChunk]]] = field(default_factory=dict)


class TorchSDPABackend(AttentionBackend):
    name: ClassVar[str] = "torch"

    def __init__(self, dtype: torch.dtype, rotary: Rotary) -> None:
        self.dtype = dtype          # the model's: the decode masks are additive in it
        self.rotary = rotary        # the rotary op the model's device and dtype select

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(common.slot_mapping, common.block_size, self.decode_groups(common),
                                      [masked_prefill_chunk(span, common.block_size, common.slot_mapping.device)
                                       for span in common.prefills], common)

    def windowed(self, meta: TorchAttentionMetadata, window: int) -> tuple[list[DecodeGroup], list[PrefillChunk]]:
        """The step's decode groups and prefill chunks for a layer that sees the last `window` keys."""
        if window not in meta.windowed:
            common = meta.common
            meta.windowed[window] = (self.decode_groups(common, window),
                                     [masked_prefill_chunk(span, common.block_size, common.slot_mapping.device,
                                                           window) for span in common.prefills])
        return meta.windowed[window]

    def decode_groups(self, common: CommonAttentionMetadata, window: int | None = None) -> list[DecodeGroup]:
        """The decodes (longest first, but for the rows of a request verifying drafts, which rise by one
        each) cut into groups of at most DECODE_GROUP_SLOTS padded slots."""
        groups: list[DecodeGroup] = []
        lens, bs = common.decode_seq_lens_cpu, common.block_size
        start = 0
        while start < common.num_decodes:
            max_len = int(lens[start:].max())
            size = max(1, min(common.num_decodes - start, DECODE_GROUP_SLOTS // max_len))
            end = start + size
            max_blocks = -(-max_len // bs)
            groups.append(self._decode_group(common.decode_block_table[start:end, :max_blocks],
                                             common.decode_seq_lens[start:end], start, end, bs, window))
            start = end
        return groups

    def _decode_group(self, table: torch.Tensor, lens: torch.Tensor, start: int, end: int,
                      block_size: int, window: int | None = None) -> DecodeGroup:
        span = table.shape[1] * block_size
        keys = torch.arange(span, device=lens.device)[None, :]
        visible = keys < lens[:, None]
        if window is not None:
            visible &= keys >= lens[:, None] - window
        # An additive mask in the model's dtype: SDPA would convert a boolean one in every layer.
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=lens.device)
        mask.masked_fill_(~visible, float("-inf")).unsqueeze_(1).unsqueeze_(1)
        return DecodeGroup(start, end, table, lens, mask)

    def write_kv(self, qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 cache: KVCache | None, meta: TorchAttentionMetadata) -> None:
        self.rotary(qkv, num_heads, cos, sin)
        if cache is not None:
            write_qkv(cache, qkv, num_heads, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                meta: TorchAttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        decodes, prefills = (meta.decodes, meta.prefills) if window is None else self.windowed(meta, window)
        out = torch.empty_like(q)
        for group in decodes:
            s, e = group.token_start, group.token_end
            out[s:e] = decode_attention(q[s:e], cache, group, meta.block_size, scale, softcap)
        for chunk in prefills:
            s, e = chunk.token_start, chunk.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], cache, chunk, meta.block_size, scale, softcap)
        return out


def context_blocks(span: PrefillSpan, block_size: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(span.block_ids[:-(-span.end_pos // block_size)]).to(device)


def masked_prefill_chunk(span: PrefillSpan, block_size: int, device: torch.device,
                         window: int | None = None) -> PrefillChunk:
    """The chunk for `prefill_attention`: over its own keys when fresh, else over its gathered context
    with query i (at position start + i) seeing keys 0 .. start + i (the padding after the chunk's
    last position is never visible); with a `window`, keys start + i - window + 1 .. start + i."""
    windowed = window is not None and span.end_pos > window
    if span.start_pos == 0 and not windowed:
        return PrefillChunk(span.token_start, span.token_end, None, None, span.end_pos)
    blocks = None if span.start_pos == 0 else context_blocks(span, block_size, device)
    num_keys = span.end_pos if blocks is None else blocks.shape[0] * block_size
    keys = torch.arange(num_keys, device=device)[None, :]
    positions = torch.arange(span.start_pos, span.end_pos, device=device)[:, None]
    mask = keys <= positions
    if windowed:
        mask &= keys > positions - window
    return PrefillChunk(span.token_start, span.token_end, blocks, mask, span.end_pos)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     softcap: float) -> torch.Tensor:
    """SDPA's result with the scores soft-capped, as Hugging Face's eager Gemma 2 attention computes it:
    q [..., Lq, D], k and v [..., L, D] (as many heads as q's), mask additive or boolean (True = may
    attend) broadcasting to [..., Lq, L]; the softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def decode_attention(q: torch.Tensor, cache: KVCache, group: DecodeGroup, block_size: int,
                     scale: float, softcap: float | None = None) -> torch.Tensor:
    n, heads, head_dim = q.shape
    k, v = gather_kv(cache, group.block_table, block_size, q.dtype)   # [n, kv_heads, len, head_dim]
    kv_heads = k.shape[1]
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become
    # that head's query rows (query head h reads KV head h // group).
    qg = q.view(n, kv_heads, heads // kv_heads, head_dim)
    if softcap is not None:
        return capped_attention(qg, k, v, group.mask, scale, softcap).reshape(n, heads, head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)
    return o.reshape(n, heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                      chunk: PrefillChunk, block_size: int, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
    qh = q.transpose(0, 1).unsqueeze(0)                  # [1, heads, q_len, head_dim]
    if chunk.context_blocks is None:   # its own keys: causal, or masked to a window
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
    else:
        kh, vh = gather_kv(cache, chunk.context_blocks, block_size, q.dtype)  # [kv_heads, len, head_dim]
        kh, vh = kh.unsqueeze(0), vh.unsqueeze(0)
    if softcap is not None:
        group = qh.shape[1] // kh.shape[1]
        mask = chunk.mask
        if mask is None:   # causal on its own keys
            mask = torch.ones(qh.shape[2], kh.shape[2], dtype=torch.bool, device=q.device).tril_()
        o = capped_attention(qh, kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1), mask,
                             scale, softcap)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
