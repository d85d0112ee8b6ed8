"""The backend-neutral description of a step's batch (`CommonAttentionMetadata`), from host arrays:
shared by the model runner (the target's steps) and the draft model (its guessing steps)."""

from __future__ import annotations

import numpy as np
import torch

from kestrel.attention import CommonAttentionMetadata, PrefillSpan


def describe_batch(slot_mapping: torch.Tensor, decode_seq_lens: np.ndarray, decode_block_ids: list[list[int]],
                   prefills: list[PrefillSpan], block_size: int, device: torch.device) -> CommonAttentionMetadata:
    """Decode rows (one token each: its context length, this token included, and its request's block
    ids) and prefill chunks. The block table is padded with the null block 0 to the longest row."""
    max_blocks = -(-int(decode_seq_lens.max()) // block_size) if len(decode_seq_lens) else 0
    table = np.zeros((len(decode_seq_lens), max_blocks), dtype=np.int64)
    for i, (block_ids, seq_len) in enumerate(zip(decode_block_ids, decode_seq_lens.tolist())):
        used = -(-seq_len // block_size)
        table[i, :used] = block_ids[:used]
    return CommonAttentionMetadata(slot_mapping, block_size, len(decode_seq_lens), torch.from_numpy(table).to(device),
                                   torch.from_numpy(decode_seq_lens).to(device), decode_seq_lens, prefills)


def slots_of(positions: np.ndarray, block_ids: list[int], block_size: int) -> np.ndarray:
    """Where the K and V of a request's tokens at `positions` go in the cache."""
    table = np.asarray(block_ids, dtype=np.int64)
    return table[positions // block_size] * block_size + positions % block_size
