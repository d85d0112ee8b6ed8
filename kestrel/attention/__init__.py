"""Attention over the paged KV cache, behind one interface (`AttentionBackend`), and the cache's layout.

The worker chooses a backend once (`select_attention_backend`); the model runner describes each
step's batch (`CommonAttentionMetadata`), the backend turns that into its metadata once per step, and
every layer calls the backend's `write_kv` and `forward`. Backends: the PyTorch reference
(`TorchSDPABackend`, any device) and the compiled CPU kernels (`CpuKernelsBackend`). The runner never
asks which kernels exist.
"""

from kestrel.attention.backend import AttentionBackend, CommonAttentionMetadata, DecodeStepKernels, PrefillSpan
from kestrel.attention.cpu import CpuAttentionMetadata, CpuKernelsBackend
from kestrel.attention.kv_cache import KVCache, gather_kv, is_int8, new_kv_caches, quantize_rows, write_kv
from kestrel.attention.selector import ATTENTION_BACKENDS, cpu_backend_unavailable, select_attention_backend
from kestrel.attention.torch_sdpa import DecodeGroup, PrefillChunk, TorchAttentionMetadata, TorchSDPABackend

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "CommonAttentionMetadata", "CpuAttentionMetadata", "CpuKernelsBackend",
    "DecodeGroup", "DecodeStepKernels", "KVCache", "PrefillChunk", "PrefillSpan", "TorchAttentionMetadata",
    "TorchSDPABackend", "cpu_backend_unavailable", "gather_kv", "is_int8", "new_kv_caches", "quantize_rows",
    "select_attention_backend", "write_kv",
]
