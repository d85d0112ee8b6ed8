"""--kv-cache-dtype int8: the quantized KV cache (layout in kestrel/attention/kv_cache.py). The write
kernel is bit-identical to the PyTorch reference, decode attention over it matches attention over the
dequantized cache, and the engine runs with it: ~1.9x the blocks, prefix caching, chunked prefill,
preemption, and its cost in agreement with the default engine. (The decode plan on it:
tests/model/test_decode_plan.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.attention import gather_kv, quantize_rows, write_kv
from kestrel.attention.torch_sdpa import DecodeGroup, decode_attention
from kestrel.model.layers import RotaryEmbedding, apply_rotary
from kestrel.ops import cpu_kernels
from tests.support.parity import save_tiny_llama, worker_of
from tests.support.skips import needs_cpu

kernels = cpu_kernels()  # whichever build this CPU (or KESTREL_CPU_KERNELS) takes
needs_kernels = pytest.mark.skipif(kernels is None, reason=needs_cpu("AVX2"))


def _int8_cache(num_blocks: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    return (torch.zeros(num_blocks, kv_heads, head_dim, 16, dtype=torch.int8),
            torch.zeros(num_blocks, kv_heads, 16), torch.zeros(num_blocks * 16, kv_heads, head_dim, dtype=torch.int8),
            torch.zeros(num_blocks * 16, kv_heads))


def test_quantize_rows_bounds_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None]
    x[7] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert scale[7] == 0 and not q[7].any()
    err = (q.float() * scale[:, None] - x).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()   # half a step at most


def test_gather_dequantizes_what_write_stored():
    g = torch.Generator().manual_seed(1)
    cache = _int8_cache(8, 3, 64)
    slots = torch.tensor([17, 18, 19, 40, 5])
    k, v = torch.randn(5, 3, 64, generator=g), torch.randn(5, 3, 64, generator=g)
    write_kv(cache, k, v, slots)
    kh, vh = gather_kv(cache, torch.tensor([[1, 2], [0, 1]]), 16, torch.float32)   # [2, 3, 32, 64]
    for (row, pos), slot in zip([(0, 1), (0, 2), (0, 3), (0, 24)], [17, 18, 19, 40]):
        i = slots.tolist().index(slot)
        qk, sk = quantize_rows(k[i])
        torch.testing.assert_close(kh[row, :, pos], qk.float() * sk[:, None], rtol=0, atol=0)
        qv, sv = quantize_rows(v[i])
        torch.testing.assert_close(vh[row, :, pos], qv.float() * sv[:, None], rtol=0, atol=0)
    assert kh[1, :, 5].abs().max() > 0 and kh[1, :, 6].abs().max() == 0   # block 0 holds slot 5 only


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 4, 4, 128), (300, 8, 2, 64)])
def test_rotary_write_kv_int8_is_bit_exact_with_the_reference(dtype, tokens, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    qkv[0, heads] = 0   # a zero K row: scale 0
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,), generator=g))
    slots = torch.randperm(512, generator=g)[:tokens]
    expected_cache, cache = _int8_cache(32, kv_heads, head_dim), _int8_cache(32, kv_heads, head_dim)
    expected = qkv.clone()
    expected[:, :heads + kv_heads] = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    write_kv(expected_cache, expected[:, heads:heads + kv_heads], expected[:, heads + kv_heads:], slots)
    kernels.rotary_write_kv_int8(qkv, cos, sin, *cache, slots, heads)
    assert torch.equal(qkv, expected)
    for got, want in zip(cache, expected_cache):
        assert torch.equal(got, want)
    assert expected_cache[1].count_nonzero() == tokens * kv_heads - 1


def _int8_batch(lens: list[int], kv_heads: int, head_dim: int, group: int, q_dtype: torch.dtype, seed: int):
    """q, an int8 cache of random rows, block tables (blocks in shuffled order) and seq_lens for `lens`."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-L // 16) for L in lens) + 4
    cache = _int8_cache(num_blocks, kv_heads, head_dim)
    slots = torch.arange(num_blocks * 16)
    write_kv(cache, torch.randn(len(slots), kv_heads, head_dim, generator=g) * 3,
             torch.randn(len(slots), kv_heads, head_dim, generator=g), slots)
    ids = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(lens), max(1, -(-max(lens) // 16))), dtype=np.int64)
    used = 0
    for i, L in enumerate(lens):
        n = -(-L // 16)
        table[i, :n] = ids[used:used + n]
        used += n
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(q_dtype)
    return q, cache, torch.from_numpy(table), torch.tensor(lens)


def _int8_reference(q, cache, table, seq_lens, head_dim):
    span = table.shape[1] * 16
    visible = torch.arange(span)[None, :] < seq_lens[:, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(len(seq_lens), 1, 1, span)
    group = DecodeGroup(0, len(seq_lens), table, seq_lens, mask)
    return decode_attention(q.float(), cache, group, 16, head_dim ** -0.5)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernels
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, group, kv_heads", [(64, 3, 3), (64, 1, 2), (128, 4, 2), (64, 8, 1), (64, 7, 2),
                                                     (128, 6, 1)])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_decode_attention_int8_matches_the_dequantized_reference(q_dtype, head_dim, group, kv_heads, threads):
    q, cache, table, seq_lens = _int8_batch([1, 15, 16, 17, 100, 257, 700], kv_heads, head_dim, group, q_dtype,
                                            seed=head_dim + group)
    out = kernels.paged_decode_attention_int8(q, *cache, table, seq_lens, 16, head_dim ** -0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _int8_reference(q, cache, table, seq_lens, head_dim), atol=2e-5, rtol=1e-4)
    rounded = kernels.paged_decode_attention_int8(q, *cache, table, seq_lens, 16, head_dim ** -0.5, in_q_dtype=True)
    assert torch.equal(rounded, out.to(q_dtype))


@needs_kernels
@pytest.mark.parametrize("lens", [[900, 300, 200, 120, 64, 40, 33, 17, 16, 9, 5, 1],  # longest first, as decoded
                                  [1000],                                               # fewer items than threads
                                  [3, 2000, 1, 50]])                                     # one item holds most of it
@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_decode_attention_int8_shares_uneven_batches_correctly(lens, threads):
    """Threads take runs of (sequence, KV head) items by cost; every item is computed exactly once."""
    q, cache, table, seq_lens = _int8_batch(lens, 1, 64, 8, torch.float32, seed=len(lens))
    out = kernels.paged_decode_attention_int8(q, *cache, table, seq_lens, 16, 0.125)
    torch.testing.assert_close(out, _int8_reference(q, cache, table, seq_lens, 64), atol=2e-5, rtol=1e-4)


@needs_kernels
def test_decode_attention_int8_gives_zeros_for_an_empty_context():
    q, cache, table, seq_lens = _int8_batch([40, 0, 7], 2, 64, 3, torch.float32, seed=5)
    out = kernels.paged_decode_attention_int8(q, *cache, table, seq_lens, 16, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2])
    torch.testing.assert_close(out[keep], _int8_reference(q[keep], cache, table[keep], seq_lens[keep], 64),
                               atol=2e-5, rtol=1e-4)


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-kv-int8")
    save_tiny_llama(folder, hidden_size=256, intermediate_size=512)
    return str(folder)


PROMPTS = [{"prompt_token_ids": [100 + (7 * i + 3 * j) % 4000 for j in range(n)]}
           for i, n in enumerate([5, 40, 130, 17, 77, 1, 300])]


def _kw(folder, **extra):
    return dict(model=folder, dtype="bfloat16", max_model_len=512, kv_cache_memory=16 << 20, **extra)


def test_int8_cache_holds_about_twice_the_tokens(tiny_bf16):
    default = LLM(**_kw(tiny_bf16)).llm_engine.engine_core.num_kv_blocks
    int8 = LLM(**_kw(tiny_bf16, kv_cache_dtype="int8")).llm_engine.engine_core.num_kv_blocks
    # bf16: 2 x 64 bytes per (token, head); int8: 2 x (64 + 4)
    assert abs(int8 / default - 128 / 68) < 0.02, (default, int8)


def test_bad_settings_are_refused(tiny_bf16):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(**_kw(tiny_bf16, kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        LLM(**_kw(tiny_bf16, kv_cache_dtype="int8", block_size=32))


@pytest.mark.parametrize("kernel_mode", ["compiled", "pytorch"])
def test_engine_runs_on_the_int8_cache(tiny_bf16, kernel_mode, monkeypatch, request, engine_check):
    """Chunked prefill (64-token budget), prefix-cache hits (the prompts run twice) and preemption
    (a pool too small for all at once); with the compiled kernels and on the PyTorch path, which
    agree on most tokens (their float sums differ in order). "compiled" runs whichever build this CPU
    has (AVX-512 or AVX2; both have the int8 kernels)."""
    if kernel_mode == "pytorch":
        monkeypatch.setenv("KESTREL_DISABLE_CPU_KERNELS", "1")
        cpu_kernels.cache_clear()
        request.addfinalizer(cpu_kernels.cache_clear)
    elif cpu_kernels() is None:
        pytest.skip(needs_cpu("AVX2"))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(**{**_kw(tiny_bf16, kv_cache_dtype="int8", max_num_batched_tokens=64), "kv_cache_memory": None,
                 "num_kv_blocks": 36})
    runner = worker_of(llm).runner
    assert runner.attn.name == ("cpu" if kernel_mode == "compiled" else "torch")
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    again = [o.outputs[0].token_ids for o in outs]
    engine_check(llm)
    assert all(len(t) == 16 for t in first + again)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    same = sum(a == b for a, b in zip(first, again))
    assert same >= len(PROMPTS) - 2, (first, again)


@pytest.mark.slow
def test_default_model_agrees_with_the_bf16_cache():
    """SmolLM2-135M with its keys read back from the int8 cache: 98.4% teacher-forced agreement
    measured over 16 prompts (BENCHMARKS.md); a broken quantizer or kernel gives noise."""
    from kestrel.bench.parity import measure
    result = measure({"kv_cache_dtype": "int8"}, num_prompts=6, max_tokens=32)
    assert result.sequences == 6 and result.forced_positions >= 6 * 8
    assert result.forced_agreement >= 0.93, result


def test_benchmark_reports_name_the_cache():
    from kestrel.bench.throughput_report import _precision
    assert _precision({"dtype": "bfloat16"}) == "bfloat16"
    assert _precision({"dtype": "bfloat16", "kv_cache_dtype": "auto", "quantization": None}) == "bfloat16"
    assert _precision({"dtype": "bfloat16", "kv_cache_dtype": "int8", "quantization": "int8"}) == \
        "bfloat16 with --quantization int8 and an int8 KV cache"
