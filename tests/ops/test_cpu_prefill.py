"""The prefill-attention kernels against exact attention and SDPA, and their wiring in the CPU kernels
attention backend (fresh prompts, chunks over a cached context): csrc/prefill_attention.cpp's on AMX tiles where
the CPU has them and by AVX512-BF16 dot products on every AVX512-BF16 CPU, and its
portable one (float32 or bf16, on whichever build of the kernels runs here)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kestrel.attention import CommonAttentionMetadata, CpuKernelsBackend, PrefillSpan, TorchSDPABackend, write_kv
from kestrel.ops import cpu_kernels, cpu_prefill
from kestrel.ops.dispatch import select_rotary
from kestrel.platform import cpu_flags
from tests.support.skips import needs_cpu

_has_bf16 = {"avx512_bf16", "avx512f"} <= cpu_flags()
_has_amx = {"amx_bf16", "amx_tile"} <= cpu_flags()
kernels = cpu_prefill()
needs_bf16 = pytest.mark.skipif(not _has_bf16, reason=needs_cpu("AVX512-BF16"))
needs_amx = pytest.mark.skipif(not _has_amx, reason=needs_cpu("AMX-BF16"))
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason=needs_cpu("AVX2"))
# cpu_prefill's paths where the CPU has them (the AVX512-BF16 one runs on every AMX CPU), and the
# portable kernel wherever the CPU kernels build.
PATHS = [pytest.param("amx", marks=needs_amx), pytest.param("avx512", marks=needs_bf16),
         pytest.param("portable", marks=needs_kernels)]


def _kernel(path: str):
    return cpu_kernels().prefill_attention if path == "portable" else getattr(kernels, f"prefill_attention_{path}")


@pytest.fixture(params=PATHS)
def prefill_attention(request):
    return _kernel(request.param)


@needs_bf16
def test_kernel_builds_and_runs_on_this_cpu():
    assert kernels is not None and kernels.amx_usable() == _has_amx
    assert not hasattr(kernels, "prefill_attention_amx") or _has_amx


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention in float64: q [Lq, H, D] are the last Lq of k, v [Lk, KV, D]."""
    lq, lk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)
    kh = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vh = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = qh @ kh.transpose(1, 2) * scale
    hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
    return (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ vh).transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    lq, lk = q.shape[0], k.shape[0]
    visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("lq,lk", [(1, 1), (2, 2), (15, 15), (16, 16), (17, 17), (31, 31), (33, 33), (100, 100),
                                   (300, 300), (1, 77), (40, 300), (16, 48), (5, 1000)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (2, 1, 32)])
def test_matches_exact_attention_as_closely_as_sdpa(prefill_attention, lq, lk, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(lq * 7919 + lk * 31 + heads)
    # q, k and v as slices of one fused projection, as the model passes them (strided rows).
    qkv = (torch.randn(lk, heads + 2 * kv_heads, head_dim, generator=gen) * 2).bfloat16()
    q, k, v = qkv[lk - lq:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    scale = 1 / math.sqrt(head_dim)
    out = prefill_attention(q, k, v, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (lq, heads, head_dim) and out.is_contiguous()
    exact = _exact(q, k, v, scale)
    err = (out.double() - exact).abs().max().item()
    sdpa_err = (_sdpa(q, k, v, scale).double() - exact).abs().max().item()
    # Both round the weights and the output to bf16; the kernel must not be markedly worse.
    assert err <= 2 * sdpa_err + 2 ** -8, (err, sdpa_err)


@pytest.mark.parametrize("lq,lk", [(1, 1), (17, 17), (100, 100), (300, 300), (5, 1000), (40, 300), (600, 600)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 48)])
@needs_kernels
def test_the_portable_kernel_in_float32_matches_exact_attention_as_closely_as_sdpa(lq, lk, heads, kv_heads,
                                                                                   head_dim):
    gen = torch.Generator().manual_seed(lq * 7919 + lk * 31 + heads)
    qkv = torch.randn(lk, heads + 2 * kv_heads, head_dim, generator=gen) * 2
    q, k, v = qkv[lk - lq:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels().prefill_attention(q, k, v, scale)
    assert out.dtype == torch.float32 and out.shape == (lq, heads, head_dim) and out.is_contiguous()
    exact = _exact(q, k, v, scale)
    err = (out.double() - exact).abs().max().item()
    sdpa_err = (_sdpa(q, k, v, scale).double() - exact).abs().max().item()
    assert err <= 2 * sdpa_err + 1e-6, (err, sdpa_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@needs_kernels
def test_the_portable_kernel_gives_a_query_the_same_output_in_any_chunk(dtype):
    """A row's result depends on its query and the keys it sees alone: a prompt's last 77 queries as a
    chunk over the cached context give exactly what the whole prompt gave them."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(700, h, 64, generator=gen).to(dtype) for h in (9, 3, 3))
    whole = cpu_kernels().prefill_attention(q, k, v, 0.125)
    for start in (623, 699, 0, 300):
        assert torch.equal(cpu_kernels().prefill_attention(q[start:], k, v, 0.125), whole[start:])
        assert torch.equal(cpu_kernels().prefill_attention(q[:start + 1], k[:start + 1], v[:start + 1], 0.125),
                           whole[:start + 1])


def test_large_scores_and_a_late_maximum_rescale_the_output(prefill_attention):
    # Scores of several hundred: the running max rises late in the row (the rescaling path: the
    # portable kernel raises it once per 256 keys, the others once per 32), and exp would overflow
    # without subtracting it.
    lk, heads, kv_heads, d = 700, 4, 2, 64
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(lk, heads, d, generator=gen) * 4).bfloat16()
    k = (torch.randn(lk, kv_heads, d, generator=gen) * 4).bfloat16()
    k[150:200] *= 2
    k[550:] *= 3
    v = torch.randn(lk, kv_heads, d, generator=gen).bfloat16()
    out = prefill_attention(q, k, v, 1.0)
    assert torch.isfinite(out.float()).all()
    exact = _exact(q, k, v, 1.0)
    sdpa_error = (_sdpa(q, k, v, 1.0).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * sdpa_error + 2 ** -8


@pytest.mark.parametrize("threads", [1, 2])
def test_same_result_on_any_number_of_threads(prefill_attention, threads):
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(300, h, 64, generator=gen).bfloat16() for h in (9, 3, 3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = prefill_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, prefill_attention(q, k, v, 0.125))


def test_rejects_what_it_cannot_do(prefill_attention):
    q, kv = torch.zeros(4, 4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        prefill_attention(q.half(), kv.half(), kv.half(), 1.0)            # float16
    with pytest.raises(RuntimeError):
        prefill_attention(q, kv.float(), kv, 1.0)                          # mixed dtypes
    with pytest.raises(RuntimeError):
        prefill_attention(q, kv[:3], kv[:3], 1.0)                          # fewer keys than queries
    with pytest.raises(RuntimeError):
        prefill_attention(q[..., :40], kv[..., :40], kv[..., :40], 1.0)    # head_dim % 16 != 0
    with pytest.raises(RuntimeError):
        prefill_attention(torch.zeros(4, 3, 64, dtype=torch.bfloat16), kv, kv, 1.0)  # 3 heads on 2
    with pytest.raises(RuntimeError):
        prefill_attention(q.transpose(1, 2).contiguous().transpose(1, 2), kv, kv, 1.0)  # strided D


@needs_bf16
@pytest.mark.parametrize("path", [pytest.param("amx", marks=needs_amx), "avx512"])
def test_the_bf16_kernels_take_bf16_and_whole_32s_of_head_dim(path):
    q, kv = torch.zeros(4, 4, 64, dtype=torch.bfloat16), torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        _kernel(path)(q.float(), kv.float(), kv.float(), 1.0)
    with pytest.raises(RuntimeError):
        _kernel(path)(q[..., :48], kv[..., :48], kv[..., :48], 1.0)


def test_cpu_backend_uses_it_for_fresh_and_continued_chunks(prefill_attention):
    """A step of two prefill chunks, one a fresh prompt and one continuing a context already in the
    paged cache: the CPU backend (on the kernel) agrees with the PyTorch reference backend (SDPA)."""
    heads, kv_heads, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    cache = tuple(torch.zeros(64 * bs, kv_heads, d, dtype=torch.bfloat16) for _ in range(2))
    # Request B: 50 tokens already cached in blocks 7, 3, 9, 12; this step brings tokens 50..69.
    table_b = torch.tensor([7, 3, 9, 12, 20])
    ctx = torch.randn(2, 50, kv_heads, d, generator=gen).bfloat16()
    old = torch.arange(50)
    old_slots = table_b[old // bs] * bs + old % bs
    cache[0][old_slots], cache[1][old_slots] = ctx[0], ctx[1]
    n_a, n_b = 37, 20
    q = torch.randn(n_a + n_b, heads, d, generator=gen).bfloat16()
    k = torch.randn(n_a + n_b, kv_heads, d, generator=gen).bfloat16()
    v = torch.randn(n_a + n_b, kv_heads, d, generator=gen).bfloat16()
    new = torch.arange(50, 70)
    slots = torch.cat([torch.tensor([30 * bs]) + torch.arange(n_a), table_b[new // bs] * bs + new % bs])
    write_kv(cache, k, v, slots)
    spans = [PrefillSpan(0, n_a, 0, np.array([30, 31, 32])), PrefillSpan(n_a, n_a + n_b, 50, table_b.numpy())]
    no_decodes = torch.zeros(0, dtype=torch.long)
    common = CommonAttentionMetadata(slots, bs, 0, no_decodes.view(0, 0), no_decodes, np.zeros(0, dtype=np.int64),
                                     spans)
    rotary = select_rotary(torch.device("cpu"), torch.bfloat16)
    backends = (TorchSDPABackend(torch.bfloat16, rotary),
                CpuKernelsBackend(cpu_kernels(), prefill_attention, False, rotary))
    outs = [b.forward(q, k, v, cache, b.build_metadata(common), 0.125) for b in backends]
    sdpa_out, kernel_out = (o.double() for o in outs)
    assert (kernel_out - sdpa_out).abs().max().item() < 2 ** -5
    # Each query's output is a weighted mean of the V rows it may see: the chunk over a context
    # must differ from attention over its own 20 tokens alone.
    alone = prefill_attention(q[n_a:], k[n_a:], v[n_a:], 0.125).double()
    assert (kernel_out[n_a:] - alone).abs().max().item() > 0.1


@needs_amx   # (without AMX there is one path only)
def test_the_two_paths_agree():
    """The same products (exact bf16 pairs summed in float32) and the same softmax: the paths differ
    only in the order of the float32 sums, so the outputs differ by at most a bf16 rounding or two."""
    gen = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(333, h, 64, generator=gen).bfloat16() for h in (9, 3, 3))
    amx, dot = (_kernel(path)(q, k, v, 0.125).float() for path in ("amx", "avx512"))
    assert (amx - dot).abs().max().item() <= 2 ** -6

