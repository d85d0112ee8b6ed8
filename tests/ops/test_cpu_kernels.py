"""The compiled CPU kernels (kestrel/ops) against their PyTorch references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kestrel.attention.torch_sdpa import DecodeGroup, decode_attention
from kestrel.model.layers import rms_norm_reference
from kestrel.ops import cpu_kernels, cpu_kernels_isa
from kestrel.ops.dispatch import F32_MAX_ROWS, f32_kernels, select_linear
from tests.support.decode_layers_case import decode_layers_case
from tests.support.skips import needs_cpu

# Without AVX-512 or AVX2 the kernels are not built and the PyTorch path (covered by the parity tests)
# runs. With either, a kernel that fails to build is a failure here, not a silent fallback; the tests
# run against whichever build of the kernels this CPU takes (AVX-512, or AVX2 + FMA); every build
# has every kernel.
pytestmark = pytest.mark.skipif(cpu_kernels_isa() is None, reason=needs_cpu("AVX2"))
kernels = cpu_kernels() if cpu_kernels_isa() is not None else None


def test_kernels_build_on_this_cpu():
    assert kernels is not None, "the CPU kernels failed to build (see the warning logged by kestrel.ops)"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _paged_case(dtype, head_dim, group, kv_heads, lens, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-L // block_size) for L in lens) + 8
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    ids = rng.permutation(np.arange(1, num_blocks))  # scattered blocks, never the null block
    max_blocks = -(-max(lens) // block_size)
    table = np.zeros((len(lens), max_blocks), dtype=np.int64)
    used = 0
    for i, L in enumerate(lens):
        n = -(-L // block_size)
        table[i, :n] = ids[used:used + n]
        used += n
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k, v, torch.from_numpy(table), torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group, kv_heads", [(64, 3, 3), (64, 1, 4), (128, 4, 2), (64, 8, 1), (256, 4, 1),
                                                     (64, 7, 2), (64, 6, 1), (128, 3, 2), (128, 6, 2), (128, 7, 1)])
def test_paged_decode_attention_matches_sdpa(dtype, head_dim, group, kv_heads):
    lens = [1, 15, 16, 17, 33, 100, 257]  # block boundaries and a one-token context
    q, k, v, table, seq_lens = _paged_case(dtype, head_dim, group, kv_heads, lens)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, scale)
    span = table.shape[1] * 16
    visible = torch.arange(span)[None, :] < seq_lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(len(lens), 1, 1, span)
    group_meta = DecodeGroup(0, len(lens), table, seq_lens, mask)
    ref = decode_attention(q.float(), (k.float(), v.float()), group_meta, 16, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=1e-4)


def _reference(q, k, v, table, seq_lens, block_size, scale):
    span = table.shape[1] * block_size
    visible = torch.arange(span)[None, :] < seq_lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(len(seq_lens), 1, 1, span)
    group_meta = DecodeGroup(0, len(seq_lens), table, seq_lens, mask)
    return decode_attention(q.float(), (k.float(), v.float()), group_meta, block_size, scale)


@pytest.fixture
def threads():
    """Sets torch's thread count for one test, restoring it after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# The bf16 cache takes AMX scores for a bf16 q with block_size % 16 == 0 (where the CPU has AMX),
# AVX-512 scores otherwise (a float32 q, or other block sizes): vdpbf16ps on a bf16 q where the CPU
# has AVX512-BF16 and no AMX, float32 FMAs on a float32 q; a long sequence (or a batch of one) is cut
# into segments of a fixed number of blocks (4), spread across the threads, whose partial results are merged.
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 8])
@pytest.mark.parametrize("head_dim, group, kv_heads", [(64, 3, 3), (64, 1, 2), (64, 5, 1), (128, 8, 1), (128, 2, 2),
                                                     (64, 7, 2), (128, 6, 1)])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_paged_decode_attention_bf16_paths(threads, q_dtype, block_size, head_dim, group, kv_heads, num_threads):
    threads(num_threads)
    lens = [1000, 1, 15, 16, 17, 63, 64, 65, 130, 2]  # chunk (64-row) and block edges, one token
    q, k, v, table, seq_lens = _paged_case(torch.bfloat16, head_dim, group, kv_heads, lens, block_size, seed=1)
    q = q.to(q_dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k, v, table, seq_lens, block_size, scale)
    torch.testing.assert_close(out, _reference(q, k, v, table, seq_lens, block_size, scale),
                               atol=TOL[torch.float32], rtol=1e-4)


# A sliding-window layer's decodes: the kernel reads keys len - W .. len - 1 only, the first in the middle
# of a block (and of a 16-row tile where blocks are larger), against the reference's window mask.
@pytest.mark.parametrize("cache_dtype, q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim, group, kv_heads", [(64, 2, 1), (128, 4, 2), (256, 4, 1), (256, 2, 2)])
@pytest.mark.parametrize("window", [1, 5, 24, 700])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_paged_decode_attention_with_a_window_matches_the_windowed_reference(threads, cache_dtype, q_dtype,
                                                                              block_size, head_dim, group,
                                                                              kv_heads, window, num_threads):
    from kestrel.attention.torch_sdpa import TorchSDPABackend
    threads(num_threads)
    lens = [1000, 1, 15, 16, 17, 24, 25, 63, 130, 2]
    q, k, v, table, seq_lens = _paged_case(cache_dtype, head_dim, group, kv_heads, lens, block_size, seed=window)
    q = q.to(q_dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, k, v, table, seq_lens, block_size, scale, window=window)
    group_meta = TorchSDPABackend(torch.float32, None)._decode_group(table, seq_lens, 0, len(lens), block_size, window)
    ref = decode_attention(q.float(), (k.float(), v.float()), group_meta, block_size, scale)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=1e-4)
    if window < max(lens):   # the window changed something
        assert not torch.allclose(out, _reference(q, k, v, table, seq_lens, block_size, scale), atol=1e-3)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("length", [1, 5, 16, 300, 4001])
def test_paged_decode_attention_batch_of_one(threads, q_dtype, num_threads, length):
    """The latency case: one sequence, its blocks split across threads."""
    threads(num_threads)
    q, k, v, table, seq_lens = _paged_case(torch.bfloat16, 64, 3, 3, [length], seed=length)
    q = q.to(q_dtype)
    out = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125)
    torch.testing.assert_close(out, _reference(q, k, v, table, seq_lens, 16, 0.125),
                               atol=TOL[torch.float32], rtol=1e-4)


@pytest.mark.parametrize("dtype, head_dim, group, kv_heads", [(torch.bfloat16, 64, 3, 3),
                                                               (torch.float32, 128, 2, 2)])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_paged_decode_attention_gives_each_sequence_what_it_gets_alone(threads, dtype, head_dim, group,
                                                                      kv_heads, num_threads):
    """Batch invariance: a sequence's output is the same bits alone and in any batch, under any thread
    count. A thread walks its items in order, fetching the next one's rows while it computes: empty
    sequences, segment and thread edges in between change no sequence's output by a bit. (The AVX-512
    build's own kernel for a bf16 cache, decode_bf16_avx512.h, cuts a long sequence into segments of a
    fixed number of blocks, whatever the batch and the threads, and merges them in order.)"""
    threads(num_threads)
    lens = [300, 0, 17, 0, 0, 513, 1, 256, 0, 129, 128]
    q, k, v, table, seq_lens = _paged_case(dtype, head_dim, group, kv_heads, [max(L, 1) for L in lens], seed=3)
    seq_lens = torch.tensor(lens)
    batch = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125)
    for i, length in enumerate(lens):
        alone = kernels.paged_decode_attention(q[i:i + 1], k, v, table[i:i + 1], seq_lens[i:i + 1], 16, 0.125)
        assert torch.equal(batch[i:i + 1], alone), i
        if length == 0:
            assert not batch[i].any()
    threads(1 if num_threads > 1 else 2)
    assert torch.equal(kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125), batch)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_attention_in_q_dtype_rounds_as_to(q_dtype):
    """in_q_dtype: the float32 result rounded once, bit for bit as .to(q.dtype) rounds it."""
    q, k, v, table, seq_lens = _paged_case(torch.bfloat16, 64, 3, 3, [700, 33, 1, 200], seed=5)
    q = q.to(q_dtype)
    wide = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125)
    rounded = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125, in_q_dtype=True)
    assert wide.dtype == torch.float32 and rounded.dtype == q_dtype
    assert torch.equal(rounded, wide.to(q_dtype))


def test_paged_decode_attention_bf16_large_scores():
    """Scores far from 0 and rising along the context (the running max moves many times)."""
    q, k, v, table, seq_lens = _paged_case(torch.bfloat16, 64, 3, 3, [700, 33, 200])
    ramp = torch.linspace(0, 6, k.shape[0])[:, None, None]
    k = (k.float() * 3 + ramp).bfloat16()
    q = (q.float() * 3).bfloat16()
    out = kernels.paged_decode_attention(q, k, v, table, seq_lens, 16, 0.125)
    torch.testing.assert_close(out, _reference(q, k, v, table, seq_lens, 16, 0.125),
                               atol=TOL[torch.float32], rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_decode_attention_reads_only_its_blocks(dtype, block_size):
    q, k, v, table, seq_lens = _paged_case(dtype, 64, 3, 3, [20, 40, 3], block_size)
    before = kernels.paged_decode_attention(q, k, v, table, seq_lens, block_size, 0.125)
    # Poison every slot the requests do not own (including positions past each length).
    owned = torch.zeros(k.shape[0], dtype=torch.bool)
    for i, L in enumerate(seq_lens.tolist()):
        for t in range(L):
            owned[table[i, t // block_size] * block_size + t % block_size] = True
    k[~owned] = float("nan")
    v[~owned] = float("nan")
    after = kernels.paged_decode_attention(q, k, v, table, seq_lens, block_size, 0.125)
    assert not after.isnan().any()
    torch.testing.assert_close(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_residual(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, None, w, 1e-5), rms_norm_reference(x, w, 1e-5),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])
    expected_residual = residual + x
    res = residual.clone()
    out = kernels.rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, expected_residual)  # the add is rounded exactly like torch's
    torch.testing.assert_close(out, rms_norm_reference(expected_residual, w, 1e-5),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 640), (37, 256), (300, 1152)])
def test_rms_norm_with_a_float32_weight_is_gemmas_norm(dtype, rows, dim):
    """Gemma's norm: the kernel takes its float32 1 + w with a bf16 x and rounds the product once, as
    Hugging Face's Gemma3RMSNorm (gemma_rms_norm_reference); the selected op takes q/k head views too."""
    from kestrel.ops.dispatch import gemma_rms_norm_reference, select_gemma_norm
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    w = 1.0 + torch.randn(dim, generator=g) * 0.5
    ref = gemma_rms_norm_reference(x, w, 1e-6)
    torch.testing.assert_close(kernels.rms_norm(x, None, w, 1e-6), ref, atol=TOL[dtype], rtol=TOL[dtype])
    heads = (torch.randn(rows, 6, dim, generator=g)).to(dtype)[:, 1:5]   # strided, as qkv's q heads
    norm = select_gemma_norm(torch.device("cpu"), dtype, dim)
    torch.testing.assert_close(norm(heads, w, 1e-6), gemma_rms_norm_reference(heads, w, 1e-6),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 2 * 2048, generator=g) * 4).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(kernels.gelu_tanh_and_mul(x).float(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 2 * 1536, generator=g) * 4).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(kernels.silu_and_mul(x).float(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 4, 4, 128), (300, 8, 2, 64)])
def test_rotary_write_kv_is_bit_exact_with_the_reference(dtype, tokens, heads, kv_heads, head_dim):
    from kestrel.attention import write_kv
    from kestrel.model.layers import RotaryEmbedding, apply_rotary
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,), generator=g))
    slots = torch.randperm(512, generator=g)[:tokens]
    caches = [torch.zeros(512, kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    expected = qkv.clone()
    expected[:, :heads + kv_heads] = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    write_kv((caches[0], caches[1]), expected[:, heads:heads + kv_heads], expected[:, heads + kv_heads:], slots)
    kernels.rotary_write_kv(qkv, cos, sin, caches[2], caches[3], slots, heads)
    assert torch.equal(qkv, expected)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_rotary_write_kv_rejects_a_slot_outside_the_cache():
    qkv = torch.randn(2, 5, 64)
    cache = torch.zeros(16, 2, 64)
    cos = sin = torch.ones(2, 64)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.rotary_write_kv(qkv, cos, sin, cache, cache.clone(), torch.tensor([3, 16]), 1)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (1, 17), (3, 16), (8, 49152), (48, 49152), (5, 1001)])
def test_argmax_rows_matches_torch(rows, vocab):
    g = torch.Generator().manual_seed(rows * 7 + vocab)
    x = torch.randn(rows, vocab, generator=g)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    # bf16-valued logits tie often: the first index of the maximum wins, as in torch.
    xb = (x * 3).bfloat16().float()
    assert torch.equal(kernels.argmax_rows(xb), xb.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nan_follow_torch():
    x = torch.full((6, 40), -float("inf"))
    x[1, 5] = x[1, 33] = 2.0                       # a tie: index 5
    x[2, 39] = float("inf")                        # in the tail past the last full vector
    x[3, 7], x[3, 20] = float("nan"), float("inf")  # NaN is above everything
    x[4, 25], x[4, 38] = float("nan"), float("nan")
    x[5] = 0.0                                     # all equal
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert kernels.argmax_rows(x).tolist() == [0, 5, 39, 7, 25, 0]
    with pytest.raises(RuntimeError):
        kernels.argmax_rows(x.bfloat16())


def test_every_build_exports_the_same_functions():
    """Callers never ask which build they got: both have every kernel, at their own vector width."""
    for name in ("argmax_rows", "rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "paged_decode_attention",
                 "rotary_write_kv", "rotary_write_kv_int8", "paged_decode_attention_int8", "supports", "linear_f32",
                 "DecodeLayers", "matmul_address", "linear_int8", "int8_linear", "linear_bf16", "matmul_slice_address"):
        assert hasattr(kernels, name), name
    assert kernels.lanes == {"avx512": 16, "avx2": 8}[cpu_kernels_isa()]
    assert kernels.supports(64, 3) and kernels.supports(64, 7) and not kernels.supports(64, 9)


# K of 8 mod 16 (8, 72, 584): a 16-lane build reads the last 8 values through a lane mask.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize("out_features, in_features",
                         [(1, 8), (2, 576), (7, 64), (5, 72), (960, 576), (576, 1536), (4, 584), (3, 24)])
def test_linear_f32_matches_torch(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    torch.testing.assert_close(kernels.linear_f32(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_linear_takes_the_f32_kernel_for_decode_sized_batches():
    """Where float32 products take linear_f32 (the AVX2 build: f32_kernels()); on AVX-512 torch's GEMM
    keeps float32."""
    ops = select_linear(torch.device("cpu"), torch.float32)
    preferred = f32_kernels() is not None
    assert (ops.plan_matmul is not None and ops.plan_matmul.kernel is kernels.linear_f32) == preferred
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    for rows in (1, F32_MAX_ROWS):
        x = torch.randn(rows, 576, generator=g)
        if preferred:
            assert torch.equal(ops.linear(x, w), kernels.linear_f32(x, w))
            assert torch.equal(ops.linear(x, w, bias), kernels.linear_f32(x, w) + bias)
        else:
            assert torch.equal(ops.linear(x, w, bias), F.linear(x, w, bias))
    # Prefill-sized batches take torch's GEMM.
    many = torch.randn(F32_MAX_ROWS + 1, 576, generator=g)
    assert torch.equal(ops.linear(many, w), F.linear(many, w))


def test_linear_f32_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.linear_f32(torch.randn(2, 12), torch.randn(3, 12))
    with pytest.raises(RuntimeError, match="x \\[M, K\\], w \\[N, K\\]"):
        kernels.linear_f32(torch.randn(2, 16), torch.randn(3, 8))


def _decode_layers_in_python(weights, caches, x, cos, sin, slots, table, seq_lens, heads, eps, scale):
    """DecodeLayers' loop over linear_f32, kernel call by kernel call, in Python."""
    residual = None
    for layer in range(len(caches) // 2):
        norm_in, qkv_w, o_w, norm_post, gate_up_w, down_w = weights[6 * layer:6 * layer + 6]
        k_cache, v_cache = caches[2 * layer], caches[2 * layer + 1]
        if residual is None:
            residual, h = x, kernels.rms_norm(x, None, norm_in, eps)
        else:
            h = kernels.rms_norm(x, residual, norm_in, eps)
        qkv = kernels.linear_f32(h, qkv_w).view(x.shape[0], heads + 2 * k_cache.shape[1], k_cache.shape[2])
        kernels.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads)
        out = kernels.paged_decode_attention(qkv[:, :heads], k_cache, v_cache, table, seq_lens, 16, scale, True)
        h = kernels.rms_norm(kernels.linear_f32(out.reshape(x.shape[0], -1), o_w), residual, norm_post, eps)
        x = kernels.linear_f32(kernels.silu_and_mul(kernels.linear_f32(h, gate_up_w)), down_w)
    return x + residual


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_decode_layers_f32_is_its_kernels_in_order(rows):
    """DecodeLayers over linear_f32 (in every build) against the same kernels called from Python, bit for bit, and
    within float32 rounding of the PyTorch references."""
    case = decode_layers_case(rows, torch.float32, heads=4, kv_heads=2, head_dim=64, hidden=256, inter=512, layers=2,
                              seed=rows)
    eps = 1e-5
    native_caches = [c.clone() for c in case.caches]
    native = kernels.DecodeLayers(case.weights, native_caches, case.heads, eps, case.scale,
                                  kernels.matmul_address("linear_f32"))(case.x.clone(), *case.step_args())
    python_loop = _decode_layers_in_python(case.weights, case.caches, case.x.clone(), case.cos, case.sin, case.slots,
                                           case.table, case.seq_lens, case.heads, eps, case.scale)
    assert torch.equal(native, python_loop)
    assert all(torch.equal(a, b) for a, b in zip(native_caches, case.caches))  # the same K/V written


def test_decode_layers_rejects_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="no matmul"):
        kernels.matmul_address("linear_int8")   # not a MatmulFn: its weights come with scales
    weights = [torch.ones(32), torch.randn(96, 32), torch.randn(32, 32), torch.ones(32),
               torch.randn(64, 32).bfloat16(), torch.randn(32, 32)]
    caches = [torch.zeros(16, 1, 32), torch.zeros(16, 1, 32)]
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.DecodeLayers(weights, caches, 1, 1e-5, 1.0, kernels.matmul_address("linear_f32"))
    with pytest.raises(RuntimeError, match="6 weights and 2 caches"):
        kernels.DecodeLayers(weights[:5], caches, 1, 1e-5, 1.0, kernels.matmul_address("linear_f32"))
