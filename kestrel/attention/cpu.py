"""The CPU kernels backend (kestrel/ops/csrc: decode_attention.cpp, prefill_attention.cpp): decode attention reads the
paged cache in place (bf16/float32 or int8 cache), all decodes of a step in one call; the q/k rotary
and the KV write run as one fused kernel; prefill chunks run on cpu_prefill's kernel (AMX tiles, or
AVX512-BF16 dot products) where the CPU has AVX512-BF16 and the model is bf16 with head_dim % 32 == 0
(up to 256), else on cpu_kernels' prefill_attention where that is preferred (the AVX2 build; float32
or bf16, head_dim % 16 == 0), else on the reference's SDPA path (selector.py chooses).

A sliding-window layer's decodes run on the decode kernel with its window; its prefill chunks that
reach past the window run on the reference's masked SDPA, as do its decodes over the int8 cache
(whose kernel has no window). A step whose contexts all fit the window runs such a layer as a full one.
A soft-capped layer (Gemma 2) runs on the reference's plain-operation attention: no kernel caps scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kestrel.attention.backend import AttentionBackend, CommonAttentionMetadata, DecodeStepKernels, PrefillSpan
from kestrel.attention.kv_cache import KVCache, gather_kv, write_qkv
from kestrel.attention.torch_sdpa import (
    PrefillChunk,
    TorchSDPABackend,
    context_blocks,
    masked_prefill_chunk,
    prefill_attention,
)
from kestrel.ops.dispatch import Rotary, rotary_kernel_takes


@dataclass
class CpuAttentionMetadata:
    slot_mapping: torch.Tensor
    block_size: int
    num_decodes: int
    decode_block_table: torch.Tensor      # [num_decodes, max_blocks], null-block padded
    decode_seq_lens: torch.Tensor         # [num_decodes]
    prefills: list[PrefillChunk]          # mask None where the prefill kernel serves them
    common: CommonAttentionMetadata
    longest: int                          # the longest context of the step: keys its last token sees
    # built on first use in the step: ("chunks", window) -> the chunks for a window; "reference" -> the
    # reference backend and its metadata
    windowed: dict = field(default_factory=dict)


class CpuKernelsBackend(AttentionBackend):
    name: ClassVar[str] = "cpu"

    def __init__(self, kernels, prefill_kernel: Callable | None, kv_int8: bool, rotary: Rotary,
                 fused_rotary: bool | None = None) -> None:
        """`kernels`: the cpu_kernels() build, which supports the model's (head_dim, group);
        `prefill_kernel`: cpu_prefill's prefill_attention_amx or _avx512, or cpu_kernels'
        prefill_attention (each (q, k, v, scale) -> out), or None where chunks take SDPA.
        `fused_rotary`: whether the rotary and the KV write run as one kernel, decided when the backend
        is built (dispatch.rotary_kernel_serves for the model's dtype and head_dim); None: checked on
        each call (rotary_kernel_takes), for a backend built without the model's shape."""
        self.kv_int8 = kv_int8
        self.rotary = rotary
        self.fused_rotary = fused_rotary
        self.prefill_kernel = prefill_kernel
        if kv_int8:
            self._rotary_write_kv = kernels.rotary_write_kv_int8
            self._decode_attention = kernels.paged_decode_attention_int8
        else:
            self._rotary_write_kv = kernels.rotary_write_kv
            self._decode_attention = kernels.paged_decode_attention
        if prefill_kernel is not None:
            self._prefill_chunk, self._prefill = self._kernel_chunk, self._prefill_on_kernel
        else:
            self._prefill_chunk, self._prefill = masked_prefill_chunk, prefill_attention

    def describe(self) -> str:
        prefill = f"the {self.prefill_kernel.__name__} kernel" if self.prefill_kernel is not None else "SDPA prefill"
        return f"cpu (decode kernel{' on the int8 cache' if self.kv_int8 else ''}, {prefill})"

    def build_metadata(self, common: CommonAttentionMetadata) -> CpuAttentionMetadata:
        device = common.slot_mapping.device
        prefills = [self._prefill_chunk(span, common.block_size, device) for span in common.prefills]
        longest = max([int(common.decode_seq_lens_cpu[:common.num_decodes].max(initial=0))]
                      + [span.end_pos for span in common.prefills])
        return CpuAttentionMetadata(common.slot_mapping, common.block_size, common.num_decodes,
                                    common.decode_block_table, common.decode_seq_lens, prefills, common, longest)

    @staticmethod
    def _kernel_chunk(span: PrefillSpan, block_size: int, device: torch.device) -> PrefillChunk:
        """The kernel takes the first `end_pos` keys, causal from the bottom right: no mask."""
        blocks = None if span.start_pos == 0 else context_blocks(span, block_size, device)
        return PrefillChunk(span.token_start, span.token_end, blocks, None, span.end_pos)

    def write_kv(self, qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                 cache: KVCache | None, meta: CpuAttentionMetadata) -> None:
        fused = self.fused_rotary if self.fused_rotary is not None else rotary_kernel_takes(qkv, cos)
        if cache is not None and fused:
            self._rotary_write_kv(qkv, cos, sin, *cache, meta.slot_mapping, num_heads)
            return
        self.rotary(qkv, num_heads, cos, sin)
        if cache is not None:
            write_qkv(cache, qkv, num_heads, meta.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                meta: CpuAttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        if window is not None and window >= meta.longest:
            window = None   # every key of the step is inside the window
        if softcap is not None or (window is not None and self.kv_int8):
            return self._on_reference(q, k, v, cache, meta, scale, window, softcap)
        nd, bs = meta.num_decodes, meta.block_size
        windowed = () if window is None else (window,)
        if not meta.prefills:
            # A decode-only step: the kernel's output, in q's dtype, is the whole result.
            return self._decode_attention(q, *cache, meta.decode_block_table, meta.decode_seq_lens, bs, scale, True,
                                          *windowed)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_attention(q[:nd], *cache, meta.decode_block_table, meta.decode_seq_lens,
                                              bs, scale, False, *windowed)
        for chunk in meta.prefills if window is None else self._windowed_chunks(meta, window):
            s, e = chunk.token_start, chunk.token_end
            run = self._prefill if chunk.mask is None else prefill_attention   # masked: the reference's
            out[s:e] = run(q[s:e], k[s:e], v[s:e], cache, chunk, bs, scale)
        return out

    def _windowed_chunks(self, meta: CpuAttentionMetadata, window: int) -> list[PrefillChunk]:
        """The step's prefill chunks for a layer with this window: those that reach past it masked."""
        key = ("chunks", window)
        if key not in meta.windowed:
            device = meta.slot_mapping.device
            meta.windowed[key] = [
                masked_prefill_chunk(span, meta.block_size, device, window) if span.end_pos > window else chunk
                for span, chunk in zip(meta.common.prefills, meta.prefills)]
        return meta.windowed[key]

    def _on_reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                      meta: CpuAttentionMetadata, scale: float, window: int | None,
                      softcap: float | None) -> torch.Tensor:
        """The whole layer on the reference backend: soft caps (no kernel has them), or a window over the
        int8 cache (whose decode kernel has none)."""
        if "reference" not in meta.windowed:
            reference = TorchSDPABackend(q.dtype, self.rotary)
            meta.windowed["reference"] = (reference, reference.build_metadata(meta.common))
        reference, reference_meta = meta.windowed["reference"]
        return reference.forward(q, k, v, cache, reference_meta, scale, window, softcap)

    def _prefill_on_kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                           chunk: PrefillChunk, block_size: int, scale: float) -> torch.Tensor:
        """Causal attention of the chunk's queries over its keys, the queries being the last ones: its
        own keys, or the first context_len keys of its gathered context."""
        if chunk.context_blocks is not None:
            kh, vh = gather_kv(cache, chunk.context_blocks, block_size, q.dtype)  # [kv_heads, len, head_dim]
            k = kh.transpose(0, 1)[:chunk.context_len]
            v = vh.transpose(0, 1)[:chunk.context_len]
        return self.prefill_kernel(q, k, v, scale)

    def decode_step_kernels(self) -> DecodeStepKernels:
        return DecodeStepKernels(self._rotary_write_kv, self._decode_attention, self.kv_int8)
