"""Random inputs for cpu_kernels' DecodeLayers (a decode step of a small Llama-shaped layer stack over a
paged KV cache), shared by its float32 and bf16 tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeLayersCase:
    weights: list[torch.Tensor]   # 6 per layer: input norm, qkv, o, post-attention norm, gate_up, down
    caches: list[torch.Tensor]    # k, v per layer: [slots, kv_heads, head_dim]
    x: torch.Tensor               # [rows, hidden]
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    heads: int
    scale: float

    def step_args(self) -> tuple:
        """What DecodeLayers' call takes after x (block size 16)."""
        return self.cos, self.sin, self.slots, self.table, self.seq_lens, 16


def decode_layers_case(rows: int, dtype: torch.dtype, *, heads: int, kv_heads: int, head_dim: int, hidden: int,
                       inter: int, layers: int, seed: int) -> DecodeLayersCase:
    """`rows` sequences of 5, 16, 27, ... tokens (the last one being decoded), each in its own blocks."""
    g = torch.Generator().manual_seed(seed)
    weights = []
    for _ in range(layers):
        weights += [1 + 0.1 * torch.randn(hidden, generator=g),
                    0.05 * torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=g),
                    0.05 * torch.randn(hidden, heads * head_dim, generator=g),
                    1 + 0.1 * torch.randn(hidden, generator=g),
                    0.05 * torch.randn(2 * inter, hidden, generator=g),
                    0.05 * torch.randn(hidden, inter, generator=g)]
    lens = [5 + 11 * i for i in range(rows)]
    blocks = max(lens) // 16 + 1
    table = torch.arange(rows * blocks).view(rows, blocks) + 1
    slots = torch.tensor([table[i, (n - 1) // 16].item() * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    caches = [0.5 * torch.randn((rows * blocks + 1) * 16, kv_heads, head_dim, generator=g) for _ in range(2 * layers)]
    x = torch.randn(rows, hidden, generator=g)
    angle = torch.tensor(lens, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1, head_dim)[None, :]
    return DecodeLayersCase([w.to(dtype) for w in weights], [c.to(dtype) for c in caches], x.to(dtype),
                            angle.cos().to(dtype), angle.sin().to(dtype), slots, table, torch.tensor(lens), heads,
                            head_dim ** -0.5)
