"""The attention backend interface, and the backend-neutral description of a step's batch that the
model runner hands to it.

Layout of a step's flattened batch (the runner guarantees it): first the decodes (requests with one
token this step), one row each, longest context first; then each prefill chunk's tokens, contiguous.
Once per step the runner describes it (`CommonAttentionMetadata`) and the backend's `build_metadata`
turns the description into its own metadata, which every layer then passes to `write_kv` and `forward`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from kestrel.attention.kv_cache import KVCache


@dataclass
class PrefillSpan:
    """One request's prefill chunk: rows [token_start, token_end) of the batch, at positions
    start_pos .. start_pos + (token_end - token_start) - 1 of the request."""
    token_start: int
    token_end: int
    start_pos: int            # 0: a fresh prompt, no context in the cache before it
    block_ids: np.ndarray     # the request's block table (int64), covering at least the chunk's last position

    @property
    def end_pos(self) -> int:
        """Keys the chunk's last token sees (its position + 1)."""
        return self.start_pos + self.token_end - self.token_start


@dataclass
class CommonAttentionMetadata:
    """The backend-neutral description of one step's batch (vLLM's name)."""
    slot_mapping: torch.Tensor          # [num_tokens] where each token's K/V is written
    block_size: int
    num_decodes: int                    # rows [0, num_decodes) are decodes (one per token: a request
                                        # verifying k drafts has k + 1 rows, at rising positions)
    decode_block_table: torch.Tensor    # [num_decodes, max_blocks] block ids, requests longest context
                                        # first, padded with the null block 0
    decode_seq_lens: torch.Tensor       # [num_decodes] int64 context lengths, this token included
    decode_seq_lens_cpu: np.ndarray     # the same, on the host
    prefills: list[PrefillSpan]

    @property
    def is_decode_only(self) -> bool:
        return not self.prefills


@dataclass(frozen=True)
class DecodeStepKernels:
    """What a backend gives a decode plan (kestrel/model/decode_plan.py): its raw calls for a
    decode-only step, bound once, without per-call checks. Both take the layer's cache unpacked."""
    rotary_write_kv: Callable   # (qkv, cos, sin, *cache, slot_mapping, num_heads): q, k rotated, k, v written
    decode_attention: Callable  # (q, *cache, block_table, seq_lens, block_size, scale, True) -> [n, heads, D]
    kv_int8: bool


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one model and cache configuration, chosen once by the
    worker (kestrel/attention/selector.py).

    Per step: `build_metadata` once; per layer: `write_kv` (rotary of q and k, fused with the KV
    write where a kernel can), then `forward`. A cache of None is the memory profile run: nothing is
    written and every chunk starts at position 0."""

    name: ClassVar[str]

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for a step, shared by every layer."""

    @abstractmethod
    def write_kv(self, qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 cache: KVCache | None, meta: Any) -> None:
        """Rotate the q and k heads of qkv [tokens, num_heads + 2 kv_heads, head_dim] in place, and
        write the (rotated) k and the v heads to the cache at meta's slots."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, meta: Any,
                scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """q [N, heads, head_dim], k and v [N, kv_heads, head_dim] of this step's tokens (already in
        the cache) → [N, heads, head_dim]. `window`: a sliding-window layer's W, a token at position p
        seeing keys p - W + 1 .. p only; None: every key up to its own. `softcap`: scores s become
        softcap * tanh(s / softcap) before the softmax (Gemma 2); None: as they are."""

    def decode_step_kernels(self) -> DecodeStepKernels | None:
        """Raw kernels for a decode plan; None: this backend has none, decode steps run the forward."""
        return None

    def describe(self) -> str:
        return self.name
