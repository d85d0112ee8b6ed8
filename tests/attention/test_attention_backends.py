"""Attention backends (kestrel/attention): the worker's one choice from the device, dtype, cache and
model shape and --attention-backend, a clear error where the backend asked for cannot serve, and the
same greedy tokens from the PyTorch reference and the CPU kernels on a tiny model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kestrel import LLM
from kestrel.attention import (
    CommonAttentionMetadata,
    CpuKernelsBackend,
    TorchSDPABackend,
    cpu_backend_unavailable,
    select_attention_backend,
)
from kestrel.attention.torch_sdpa import DECODE_GROUP_SLOTS, decode_attention
from kestrel.config import DeviceConfig
from kestrel.engine.arg_utils import EngineArgs, create_engine_config
from kestrel.ops import cpu_kernels, prefill_attention_preferred
from kestrel.ops.dispatch import rotary_reference
from kestrel.platform import cpu_flags
from tests.support.parity import assert_greedy_close, kestrel_greedy, save_tiny_llama, worker_of
from tests.support.skips import needs_cpu

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason=needs_cpu("AVX2"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random-weight Llama the decode kernel serves (head_dim 64, 2 query heads per KV head)."""
    folder = tmp_path_factory.mktemp("tiny-llama-backends")
    save_tiny_llama(folder, hidden_size=256, intermediate_size=512)
    return str(folder)


def _config(folder: str, **kw):
    return create_engine_config(EngineArgs(model=folder, max_model_len=256, kv_cache_memory=16 << 20, **kw))[0]


@pytest.fixture
def no_kernels(monkeypatch, request):
    monkeypatch.setenv("KESTREL_DISABLE_CPU_KERNELS", "1")
    cpu_kernels.cache_clear()
    request.addfinalizer(cpu_kernels.cache_clear)


@needs_kernels
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "int8")])
def test_auto_picks_the_cpu_kernels_on_this_cpu(tiny, dtype, kv_cache_dtype):
    backend = select_attention_backend(_config(tiny, dtype=dtype, kv_cache_dtype=kv_cache_dtype))
    assert isinstance(backend, CpuKernelsBackend) and backend.name == "cpu"
    assert backend.kv_int8 == (kv_cache_dtype == "int8")
    kernels = cpu_kernels()
    step = backend.decode_step_kernels()
    expected = kernels.paged_decode_attention_int8 if kv_cache_dtype == "int8" else kernels.paged_decode_attention
    assert step.decode_attention is expected


@needs_kernels
@pytest.mark.parametrize("disable_amx", ["0", "1"])
def test_prefill_takes_amx_where_usable_else_the_dot_products_else_the_portable_kernel(tiny, monkeypatch,
                                                                                       disable_amx):
    monkeypatch.setenv("KESTREL_DISABLE_AMX", disable_amx)
    flags = cpu_flags()
    backend = select_attention_backend(_config(tiny, dtype="bfloat16"))
    f32 = select_attention_backend(_config(tiny, dtype="float32"))
    # Where cpu_prefill's kernels do not serve: cpu_kernels' prefill_attention on the AVX2 build, else SDPA.
    portable = cpu_kernels().prefill_attention if prefill_attention_preferred() else None
    assert f32.prefill_kernel is portable
    if "avx512_bf16" not in flags:  # cpu_prefill is not built
        assert backend.prefill_kernel is portable
        assert ("prefill_attention kernel" if portable else "SDPA prefill") in backend.describe()
        return
    want = "amx" if {"amx_bf16", "amx_tile"} <= flags and disable_amx == "0" else "avx512"
    assert backend.prefill_kernel.__name__ == f"prefill_attention_{want}"
    assert f"prefill_attention_{want} kernel" in backend.describe()


def test_torch_forces_the_reference(tiny):
    backend = select_attention_backend(_config(tiny, dtype="float32", attention_backend="torch"))
    assert isinstance(backend, TorchSDPABackend) and backend.decode_step_kernels() is None


def test_a_bad_name_is_refused(tiny):
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, cpu, got 'flash'"):
        _config(tiny, attention_backend="flash")


def test_cpu_by_name_errors_where_it_cannot_serve(tiny, no_kernels):
    config = _config(tiny, dtype="float32", attention_backend="cpu")
    with pytest.raises(ValueError, match="'cpu' cannot serve this configuration: the compiled CPU kernels are"):
        select_attention_backend(config)
    # auto falls back to the reference instead
    assert isinstance(select_attention_backend(dataclasses.replace(config, attention_backend="auto")),
                      TorchSDPABackend)
    with pytest.raises(ValueError, match="cannot serve"):
        LLM(model=tiny, dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, attention_backend="cpu")


def test_cpu_backend_names_what_it_lacks(tiny):
    config = _config(tiny, dtype="float32")
    cuda = dataclasses.replace(config, device=DeviceConfig(torch.device("cuda")))
    assert cpu_backend_unavailable(cuda) == "the device is cuda, not cpu"
    # No GPU backend yet: on CUDA, auto is the PyTorch reference (choosing touches no GPU).
    assert isinstance(select_attention_backend(cuda), TorchSDPABackend)
    half = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=torch.float16))
    assert "float16" in cpu_backend_unavailable(half)
    if cpu_kernels() is not None:
        odd = dataclasses.replace(config, model=dataclasses.replace(config.model, head_dim=48))
        assert "no variant for head_dim 48" in cpu_backend_unavailable(odd)


@needs_kernels
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "int8")])
def test_both_backends_give_the_same_greedy_tokens(tiny, dtype, kv_cache_dtype, engine_check):
    """Mixed prompt lengths, chunked prefill (a 48-token budget) and batched decodes on each backend. The
    two sum in different orders, so the comparison is the parity rule: tokens equal up to a first
    difference where each side's token is in the other's top 5, and nearly every sequence equal."""
    prompts = [[100 + (7 * i + 3 * j) % 4000 for j in range(n)] for i, n in enumerate([5, 40, 130, 17, 77, 1])]
    runs = {}
    for name in ("torch", "cpu"):
        llm = LLM(model=tiny, dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20, max_num_batched_tokens=48,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=name)
        assert worker_of(llm).runner.attn.name == name
        assert worker_of(llm).model.layers[0].attn is worker_of(llm).runner.attn   # one backend, chosen once
        runs[name] = kestrel_greedy(llm, prompts, 16)
        engine_check(llm)
        del llm
    # bf16 rounds each side's differently ordered sums, and rounds the logits: this random model's
    # near-uniform bf16 logits often tie exactly, and either side may take either token of a tie.
    # So in bf16 every divergence must be at a near-tie (the reference's logprobs of the two tokens
    # within two bf16 steps of logits around 6), in float32 nearly every sequence must agree.
    atol = 2e-3 if dtype == "float32" else 0.1
    num_exact = assert_greedy_close(runs["torch"], runs["cpu"], exact=False, logprob_atol=atol)
    if dtype == "float32":
        assert num_exact >= len(prompts) - 1
    for ref, ours in zip(runs["torch"], runs["cpu"]):
        d = next((i for i, (a, b) in enumerate(zip(ref.token_ids, ours.token_ids)) if a != b), None)
        if d is not None:
            gap = ref.top[d][ref.token_ids[d]] - ref.top[d][ours.token_ids[d]]
            assert gap <= (2e-3 if dtype == "float32" else 2 * 2 ** -5), (d, gap)


def test_reference_cuts_decodes_into_groups_of_bounded_padding():
    """The reference's decode groups (longest first): each at most DECODE_GROUP_SLOTS padded slots, or
    one member alone; masks hide each member's padding; the output matches attention row by row."""
    bs, kv_heads, heads, d = 16, 2, 4, 64
    lens = np.array([2100, 1000, 30, 30, 17], dtype=np.int64)
    blocks_needed = -(-lens // bs)
    table = np.zeros((len(lens), blocks_needed[0]), dtype=np.int64)
    next_block = 1
    for i, n in enumerate(blocks_needed):
        table[i, :n] = np.arange(next_block, next_block + n)
        next_block += n
    gen = torch.Generator().manual_seed(0)
    cache = tuple(torch.randn(next_block * bs, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(len(lens), heads, d, generator=gen)
    common = CommonAttentionMetadata(torch.zeros(len(lens), dtype=torch.long), bs, len(lens), torch.from_numpy(table),
                                     torch.from_numpy(lens), lens, [])
    backend = TorchSDPABackend(torch.float32, rotary_reference)
    meta = backend.build_metadata(common)
    assert [(g.token_start, g.token_end) for g in meta.decodes] == [(0, 1), (1, 3), (3, 5)]
    for g in meta.decodes[1:]:
        assert g.mask.shape[-1] <= DECODE_GROUP_SLOTS
    out = backend.forward(q, None, None, cache, meta, d ** -0.5)
    for i, length in enumerate(lens.tolist()):
        blocks = torch.from_numpy(table[i:i + 1, :-(-length // bs)])
        alone = CommonAttentionMetadata(torch.zeros(1, dtype=torch.long), bs, 1, blocks,
                                        torch.tensor([length]), np.array([length]), [])
        group = backend.build_metadata(alone).decodes[0]
        torch.testing.assert_close(out[i:i + 1], decode_attention(q[i:i + 1], cache, group, bs, d ** -0.5))
