"""The decode plan (kestrel/model/decode_plan.py): decode-only steps run as pre-bound kernel calls,
and must give bit-identical hidden states to the model's own forward, hence the same tokens and
logprobs, in bf16, with --quantization int8 and with --kv-cache-dtype int8 (on AMX), and in float32
(on a build with linear_f32). --enforce-eager runs every step through the forward instead."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.attention import CommonAttentionMetadata, PrefillSpan
from kestrel.model.decode_plan import DecodePlan
from kestrel.model.layers import F32_MAX_ROWS
from kestrel.ops import cpu_gemv, cpu_kernels
from kestrel.ops.dispatch import amx_gemv, f32_kernels, select_ops
from tests.support.parity import save_tiny_llama, save_tiny_model, worker_of
from tests.support.skips import needs_cpu

# A bf16 model's plan binds the AMX matmul where AMX runs, else the AVX512-BF16 one (csrc/linear_bf16_avx512.cpp).
has_plan = select_ops(torch.device("cpu"), torch.bfloat16).plan_kernels is not None
needs_plan = pytest.mark.skipif(not has_plan, reason=needs_cpu("AVX2"))
# On the AVX2 build a float32 model gets a plan of its own, its projections on linear_f32 (which the
# AVX-512 build has too, but there torch's GEMM keeps float32 products: f32_kernels() is None).
has_f32_plan = cpu_kernels() is not None and f32_kernels() is not None
needs_f32_plan = pytest.mark.skipif(
    not has_f32_plan, reason=needs_cpu("AVX2") if cpu_kernels() is None
    else "needs the AVX2 build of the kernels (KESTREL_CPU_KERNELS=avx2; test_cpu_kernels_avx2_build.py runs it)")


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    """A tiny random-weight Llama whose attention the decode kernel takes (head_dim 64, 2 per KV head)."""
    folder = tmp_path_factory.mktemp("tiny-llama-plan")
    save_tiny_llama(folder, hidden_size=256, intermediate_size=512)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """The same shapes as a Qwen3: per-head q and k norms, untied output head."""
    from transformers import Qwen3Config
    folder = tmp_path_factory.mktemp("tiny-qwen3-plan")
    save_tiny_model(folder, Qwen3Config(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))
    return str(folder)


def _runner_of(llm: LLM):
    return worker_of(llm).runner


PROMPTS = [{"prompt_token_ids": [100 + (7 * i + 3 * j) % 4000 for j in range(n)]}
           for i, n in enumerate([5, 40, 130, 17, 77, 1, 300])]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)


def _generate(llm: LLM) -> list[tuple[list[int], list]]:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@needs_plan
@pytest.mark.parametrize("model, quantization, kv_cache_dtype", [
    ("tiny_bf16", None, "auto"), ("tiny_bf16", "int8", "auto"), ("tiny_qwen3", None, "auto"),
    ("tiny_bf16", None, "int8")])
def test_plan_gives_the_model_forward_bit_for_bit(model, quantization, kv_cache_dtype, request, engine_check):
    """Mixed prompt lengths, chunked prefill (a 64-token budget) and batched decodes of 1-7 rows: every
    step the plan takes is checked against the model's forward on the same inputs, and whole runs
    with and without the plan give the same tokens and logprobs."""
    llm = LLM(model=request.getfixturevalue(model), dtype="bfloat16", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    runner = _runner_of(llm)
    # The Llama's layer loop runs in C++ (DecodeLayers) where every projection is on the plan's matmul.
    native = runner.decode_plan.native_layers(runner.kv_caches)
    assert (native is not None) == (model == "tiny_bf16" and quantization is None and kv_cache_dtype == "auto")
    # Without AVX512-BF16 (linear_bf16) the projections and the output head (tied, as the tiny Llama's,
    # or not) are read packed.
    packs = runner.model.ops.pack_weight is not None
    layer = runner.model.layers[0]
    assert (getattr(layer.o_proj, "weight", torch.empty(0)).dim() == 3) == (packs and quantization is None)
    assert (runner.model.lm_head.weight.dim() == 3) == packs
    _check_plan_against_the_forward(llm, engine_check)


@needs_f32_plan
@pytest.mark.parametrize("model, kv_cache_dtype",
                         [("tiny_bf16", "auto"), ("tiny_qwen3", "auto"), ("tiny_bf16", "int8")])
def test_float32_plan_gives_the_model_forward_bit_for_bit(model, kv_cache_dtype, request, engine_check):
    """The same on a float32 model (the default dtype on a CPU without bf16), its projections on linear_f32.
    The Llama on the float cache runs its layer loop in C++ (DecodeLayers); the Qwen3, with q/k
    norms, and any model on the int8 cache, in Python."""
    llm = LLM(model=request.getfixturevalue(model), dtype="float32", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    runner = _runner_of(llm)
    plan = runner.decode_plan
    assert plan is not None and plan.max_rows == F32_MAX_ROWS
    assert not isinstance(plan.layers[0].qkv_proj, torch.nn.Module)   # bound straight to linear_f32
    native = plan.native_layers(runner.kv_caches)
    assert (native is not None) == (model == "tiny_bf16" and kv_cache_dtype == "auto")
    _check_plan_against_the_forward(llm, engine_check)


@pytest.mark.parametrize("dtype", [
    pytest.param("float32", marks=needs_f32_plan), pytest.param("bfloat16", marks=needs_plan)])
def test_native_layer_loop_matches_the_python_loop(tiny_bf16, dtype):
    """DecodeLayers against the plan's own Python loop on the same steps, bit for bit."""
    llm = LLM(model=tiny_bf16, dtype=dtype, max_model_len=512, kv_cache_memory=16 << 20)
    runner = _runner_of(llm)
    plan = runner.decode_plan
    native_class, steps = plan.native_class, []

    def both(ids, positions, kv_caches, meta):
        plan.native_class, plan._native = None, None
        python_loop = plan(ids, positions, kv_caches, meta)   # rewrites the same K/V to the same slots
        plan.native_class = native_class
        native = plan(ids, positions, kv_caches, meta)
        assert plan.native_layers(kv_caches) is not None
        assert torch.equal(native, python_loop)
        steps.append(ids.shape[0])
        return native

    runner.decode_plan = type("Both", (), {"covers": staticmethod(plan.covers), "__call__": staticmethod(both)})()
    _generate(llm)
    assert len(steps) >= 19 and max(steps) == len(PROMPTS)


def _check_plan_against_the_forward(llm: LLM, engine_check) -> None:
    runner = _runner_of(llm)
    plan = runner.decode_plan
    assert plan is not None
    rows_seen = []

    def checked(ids, positions, kv_caches, meta):
        hidden = plan(ids, positions, kv_caches, meta)
        # The model's forward rewrites the same K/V to the same slots: running it second is harmless.
        assert torch.equal(hidden, runner.model(ids, positions, kv_caches, runner.attn.build_metadata(meta)))
        rows_seen.append(ids.shape[0])
        return hidden

    runner.decode_plan = type("Checked", (), {"covers": staticmethod(plan.covers),
                                              "__call__": staticmethod(checked)})()
    with_plan = _generate(llm)
    engine_check(llm)
    assert rows_seen and max(rows_seen) >= 5 and 1 in rows_seen
    runner.decode_plan = None
    assert llm.llm_engine.engine_core.reset_prefix_cache()  # the same steps again, not cache hits
    assert _generate(llm) == with_plan
    assert all(len(tokens) == 20 for tokens, _ in with_plan)


def test_plan_covers_decode_only_steps_within_its_rows():
    covers = functools.partial(DecodePlan.covers, SimpleNamespace(max_rows=128))  # an AMX plan's rows

    def batch(num_decodes, prefills=()):
        lens = np.full(num_decodes, 5, dtype=np.int64)
        return CommonAttentionMetadata(torch.zeros(num_decodes, dtype=torch.long), 16, num_decodes,
                                       torch.ones(num_decodes, 1, dtype=torch.long), torch.from_numpy(lens), lens,
                                       list(prefills))

    assert covers(batch(1))
    assert covers(batch(128))
    assert not covers(batch(129))                                                  # beyond the AMX matmul's rows
    assert not covers(batch(1, [PrefillSpan(1, 5, 0, np.zeros(1, dtype=np.int64))]))   # mixed step
    assert not covers(batch(0, [PrefillSpan(0, 4, 0, np.zeros(1, dtype=np.int64))]))   # prefill only


@needs_plan
def test_plan_is_built_only_where_it_applies(tiny_bf16):
    llm = LLM(model=tiny_bf16, dtype="bfloat16", max_model_len=128, kv_cache_memory=8 << 20)
    plan = _runner_of(llm).decode_plan
    assert plan is not None and len(plan.layers) == 2
    assert not isinstance(plan.layers[0].qkv_proj, torch.nn.Module)   # bound straight to the AMX kernel
    del llm
    llm = LLM(model=tiny_bf16, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    assert (_runner_of(llm).decode_plan is not None) == has_f32_plan   # float32: only on a build with linear_f32
    del llm
    llm = LLM(model=tiny_bf16, dtype="bfloat16", max_model_len=128, kv_cache_memory=8 << 20, attention_backend="torch")
    assert _runner_of(llm).decode_plan is None                        # the PyTorch attention has no decode kernels


@pytest.mark.skipif(cpu_kernels() is None or cpu_gemv() is None, reason=needs_cpu("AVX512-BF16"))
def test_without_amx_the_plan_binds_the_avx512_bf16_matmul(tiny_bf16, monkeypatch, engine_check):
    """KESTREL_DISABLE_AMX=1 (an AVX512-BF16 CPU without AMX, as AMD Zen 4): the plan binds the
    matmul that the model's linear op runs there, and still gives its forward bit for bit."""
    monkeypatch.setenv("KESTREL_DISABLE_AMX", "1")
    assert amx_gemv() is None
    llm = LLM(model=tiny_bf16, dtype="bfloat16", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64)
    plan = _runner_of(llm).decode_plan
    assert plan is not None and plan.max_rows == 128
    assert plan.layers[0].qkv_proj.matmul is _runner_of(llm).model.ops.plan_kernels.matmul.kernel
    _check_plan_against_the_forward(llm, engine_check)


@needs_plan
def test_enforce_eager_runs_every_step_through_the_forward(tiny_bf16):
    """--enforce-eager: no plan is built, every step runs the model's forward, and greedy tokens and
    logprobs are those of a run with the plan (which is bit-identical to the forward)."""
    kw = dict(model=tiny_bf16, dtype="bfloat16", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64)
    llm = LLM(**kw)
    runner = _runner_of(llm)
    plan, plan_steps = runner.decode_plan, []
    assert plan is not None

    def counted(*args):
        plan_steps.append(1)
        return plan(*args)

    runner.decode_plan = type("Counted", (), {"covers": staticmethod(plan.covers), "__call__": staticmethod(counted)})()
    with_plan = _generate(llm)
    assert plan_steps
    del llm, runner
    eager = LLM(**kw, enforce_eager=True)
    runner = _runner_of(eager)
    assert runner.decode_plan is None
    forward_calls = []
    model_forward = runner.model.forward

    def forward(*args):
        forward_calls.append(args[0].shape[0])
        return model_forward(*args)

    runner.model.forward = forward
    assert _generate(eager) == with_plan
    assert 1 in forward_calls and len(forward_calls) >= 19   # decode steps of one row went through it
