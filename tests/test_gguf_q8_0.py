"""A GGUF file's Q8_0 weights kept as the file stores them (kestrel/model/quantization.py: Q8_0Linear;
cpu_kernels.cpp: linear_q8_0): the packed layout, the kernel against linear_bf16 bit for bit where the
dequantized weights are bf16 numbers (power-of-two scales) and against a float64 product elsewhere,
the reader's blocks against its dequantized tensors (rows, columns, q/k heads), and the engine on the
default model in Q8_0 giving the same tokens with the file's blocks as with the weights dequantized.
tests/test_cpu_kernels_avx2_build.py runs the q8_0 tests again on the AVX2 build."""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from parity import worker_of

from kestrel import LLM, SamplingParams
from kestrel.bench.peers import gguf_in_precision
from kestrel.model import build_model, model_config_from_hf
from kestrel.model import quantization as Q
from kestrel.model.gguf_loader import GGUFWeightReader
from kestrel.model.layers import Linear, pack_linear_weights_
from kestrel.model.loader import default_model_path, load_config, resolve_model
from kestrel.ops import cpu_gemv, cpu_kernels
from kestrel.ops.dispatch import (
    amx_gemv,
    dequantize_q8_0,
    pack_bf16_weight,
    pack_q8_0_weight,
    q8_0_plan_matmul,
    q8_0_rows,
)

kernels = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="needs a build of cpu_kernels (AVX2 or AVX-512)")


def random_q8_0_rows(n: int, k: int, gen: torch.Generator, pow2: bool) -> torch.Tensor:
    """Random Q8_0 rows [n, k / 32 * 34] (uint8): q in [-127, 127]; scales 2^-12..2^-5 (pow2) or any
    float16 in (0, 0.02)."""
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen, dtype=torch.int8)
    if pow2:
        d = torch.pow(2.0, torch.randint(-12, -4, (n, k // 32, 1), generator=gen).float()).half()
    else:
        d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02).half()
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()


def pow2_q8_0(values: np.ndarray) -> np.ndarray:
    """Q8_0 blocks of float32 `values` [..., K] with each block's scale the power of two at or above
    max|x| / 127: every dequantized value is then a bf16 number."""
    blocks = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True).clamp_min(2.0 ** -24)
    d = torch.pow(2.0, torch.ceil(torch.log2(amax / 127)))
    q = torch.round(blocks / d).clamp(-127, 127).to(torch.int8)
    raw = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return raw.reshape(*values.shape[:-1], values.shape[-1] // 32 * 34).numpy()


# ---- the layout and the kernel --------------------------------------------------------------------

def test_dequantize_q8_0_is_gguf_dequantize():
    values = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_0(torch.from_numpy(raw)).numpy(), expected)


def test_q8_0_rows_are_the_dequantized_rows_in_the_model_dtype():
    gen = torch.Generator().manual_seed(2)
    raw = random_q8_0_rows(64, 96, gen, pow2=False)
    ids = torch.tensor([0, 17, 63, 17, 31, 5])
    expected = dequantize_q8_0(raw)[ids].bfloat16()
    assert torch.equal(q8_0_rows(pack_q8_0_weight(raw), ids, torch.bfloat16), expected)


def test_pack_q8_0_weight_layout():
    """[N / 16, K / 32, 64 + 512]: per panel and block, 16 float32 scales then 32 k-rows of 16 int8."""
    gen = torch.Generator().manual_seed(1)
    raw = random_q8_0_rows(32, 64, gen, pow2=False)
    packed = pack_q8_0_weight(raw)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2, 64 + 512)
    w = dequantize_q8_0(raw)
    scales = packed[..., :64].contiguous().view(torch.float32)          # [2, 2, 16]
    quants = packed[..., 64:].contiguous().view(torch.int8).view(2, 2, 32, 16)
    rebuilt = (quants.float() * scales[:, :, None, :]).permute(0, 3, 1, 2).reshape(32, 64)
    assert torch.equal(rebuilt, w)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (960, 576), (576, 1536), (64, 2080)])
def test_linear_q8_0_is_linear_bf16_bit_for_bit_on_bf16_weights(n, k):
    """Every row count (the streamed tiles below 32 rows, the dequantized panels from there): the same
    sums in the same order as linear_bf16's packed path, so the same bits, y rounded to bf16 or not."""
    gen = torch.Generator().manual_seed(n + k)
    raw = random_q8_0_rows(n, k, gen, pow2=True)
    w = dequantize_q8_0(raw)
    assert torch.equal(w.bfloat16().float(), w)
    q8, bf16 = pack_q8_0_weight(raw), pack_bf16_weight(w.bfloat16(), kernels.panel_columns, kernels.lanes)
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 17, 31, 32, 33, 70, 130):
        x = torch.randn(m, k, generator=gen).bfloat16()
        assert torch.equal(kernels.linear_q8_0(x, q8).view(torch.int16), kernels.linear_bf16(x, bf16).view(torch.int16))
        assert torch.equal(kernels.linear_q8_0(x, q8, float_out=True), kernels.linear_bf16(x, bf16, float_out=True))


@needs_kernel
def test_linear_q8_0_is_the_product_of_the_dequantized_weights():
    gen = torch.Generator().manual_seed(7)
    raw = random_q8_0_rows(256, 1024, gen, pow2=False)
    w = dequantize_q8_0(raw).double()
    for m in (1, 9, 40):
        x = torch.randn(m, 1024, generator=gen).bfloat16()
        exact = x.double() @ w.T
        y = kernels.linear_q8_0(x, pack_q8_0_weight(raw), float_out=True).double()
        # float32 sums of 1024 products, then one rounding to bf16 (2^-9 relative)
        assert ((y - exact).abs() <= exact.abs() * 2 ** -8 + 1e-4 * exact.abs().max()).all()


@needs_kernel
def test_linear_q8_0_rejects_what_it_does_not_take():
    raw = pack_q8_0_weight(random_q8_0_rows(16, 64, torch.Generator().manual_seed(0), pow2=True))
    with pytest.raises(RuntimeError, match="linear_q8_0"):
        kernels.linear_q8_0(torch.randn(2, 96).bfloat16(), raw)      # K is not the weight's
    with pytest.raises(RuntimeError, match="bf16 x"):
        kernels.linear_q8_0(torch.randn(2, 64), raw)                  # float32 x


# ---- the reader ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_0_default(tmp_path_factory) -> Path:
    """The default model with its tensors requantized to Q8_0 by gguf's quantizer."""
    return gguf_in_precision(default_model_path(), "q8_0", cache_dir=tmp_path_factory.mktemp("q8_0"))


@pytest.fixture(scope="module")
def pow2_q8_0_default(tmp_path_factory) -> Path:
    """The default model in Q8_0 with power-of-two scales: its weights dequantize to bf16 numbers."""
    original = gguf.quants.quantize

    def quantize(values, qtype):
        return pow2_q8_0(values) if qtype == gguf.GGMLQuantizationType.Q8_0 else original(values, qtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.quants, "quantize", quantize)
        return gguf_in_precision(default_model_path(), "q8_0", cache_dir=tmp_path_factory.mktemp("q8_0_pow2"))


@pytest.mark.parametrize("name,dim,start,size", [
    ("model.layers.0.self_attn.q_proj.weight", None, 0, None),     # rows permuted by llama.cpp, whole
    ("model.layers.1.self_attn.k_proj.weight", 0, 64, 128),         # whole heads of the permuted rows
    ("model.layers.2.mlp.gate_proj.weight", 0, 100, 700),
    ("model.layers.3.self_attn.o_proj.weight", 1, 192, 384),        # a tensor-parallel share of K
    ("model.layers.4.mlp.down_proj.weight", 1, 0, 768),
])
def test_read_q8_0_is_the_dequantized_read(q8_0_default, name, dim, start, size):
    reader = GGUFWeightReader(str(q8_0_default))
    assert name in reader.q8_0_names()
    blocks = reader.read_q8_0(name, dim, start, size)
    assert blocks.dtype == torch.uint8
    assert torch.equal(dequantize_q8_0(blocks), reader.read(name, dim, start, size))


def test_read_q8_0_refuses_columns_inside_a_block(q8_0_default):
    reader = GGUFWeightReader(str(q8_0_default))
    with pytest.raises(ValueError, match="whole Q8_0 blocks"):
        reader.read_q8_0("model.layers.0.mlp.down_proj.weight", 1, 16, 64)
    with pytest.raises(ValueError, match="not a Q8_0 matrix"):
        reader.read_q8_0("model.norm.weight")


# ---- the engine ---------------------------------------------------------------------------------

def _projections(llm) -> list[torch.nn.Module]:
    return [m for layer in worker_of(llm).model.layers
            for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]


@needs_kernel
def test_engine_keeps_the_files_blocks_and_gives_the_dequantized_tokens(pow2_q8_0_default, monkeypatch,
                                                                         engine_check):
    """Mixed prompt lengths, chunked prefill (a budget of 64 tokens), a prefix-cache hit and batched
    decode. Where the model's bf16 products run linear_bf16 (no AVX512-BF16: AVX2 CPUs), every product
    with the file's blocks is bit-identical to the dequantized bf16 weights', so the whole run is.
    Elsewhere the dequantized weights take the AVX512-BF16 or AMX kernels, whose float32 sums run in
    another order: the runs agree to within those roundings."""
    prompts = [{"prompt_token_ids": [100 + (7 * i + 3 * j) % 4000 for j in range(n)]}
               for i, n in enumerate([5, 40, 130, 17, 77, 1])]
    prompts.append({"prompt_token_ids": prompts[2]["prompt_token_ids"] + [11, 12, 13]})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(model=str(pow2_q8_0_default), dtype="bfloat16", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64)
    llm = LLM(**kw)
    kept = _projections(llm)
    assert all(type(p) is Q.Q8_0Linear for p in kept) and len(kept) == 4 * 30
    assert all(p.weight.dtype == torch.uint8 and p.weight.dim() == 3 for p in kept)
    model = worker_of(llm).model   # the tied embedding and head: one module, kept too
    assert type(model.embed_tokens) is Q.Q8_0Linear and model.lm_head is model.embed_tokens
    runner = worker_of(llm).runner
    assert runner.decode_plan.native_class is not None   # decode steps run the C++ layer loop on the blocks
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine_check(llm)
    del llm
    monkeypatch.setattr(Q, "q8_0_plan_matmul", lambda: None)   # no kernel: every weight dequantized at load
    llm = LLM(**kw)
    assert all(type(p) is Linear for p in _projections(llm))
    assert type(worker_of(llm).model.lm_head) is not Q.Q8_0Linear
    dequantized = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 24 for t in native)
    if amx_gemv() is None and cpu_gemv() is None:
        assert native == dequantized
    else:
        assert all(a[:8] == b[:8] for a, b in zip(native, dequantized))
        assert sum(a == b for a, b in zip(native, dequantized)) >= len(prompts) - 2


@needs_kernel
def test_int8_quantization_overrides_the_files_blocks(q8_0_default):
    llm = LLM(model=str(q8_0_default), dtype="bfloat16", quantization="int8", max_model_len=256,
              kv_cache_memory=16 << 20)
    assert all(type(p) is Q.Int8Linear for p in _projections(llm))


def test_no_kernel_or_a_float32_model_dequantizes(q8_0_default, monkeypatch):
    """keep_gguf_q8_0_ leaves the weights to be dequantized where linear_q8_0 cannot run them."""
    src = resolve_model(str(q8_0_default))
    reader = GGUFWeightReader(src.gguf_path)
    for dtype in (torch.float32, torch.bfloat16):
        cfg = model_config_from_hf(load_config(src), model=src.path, dtype=dtype, max_model_len=64,
                                   eos_token_id=2, bos_token_id=1)
        model = build_model(cfg, torch.device("cpu"))
        expected = 4 * 30 + 1 if dtype == torch.bfloat16 and q8_0_plan_matmul() is not None else 0  # + embedding
        assert Q.keep_gguf_q8_0_(model, reader, None) == expected
    monkeypatch.setattr(Q, "q8_0_plan_matmul", lambda: None)
    assert Q.keep_gguf_q8_0_(build_model(cfg, torch.device("cpu")), reader, None) == 0


def test_a_tensor_parallel_rank_keeps_its_share_of_the_blocks(q8_0_default, monkeypatch):
    """Rank 1 of 2 on the default model (heads 6..8, KV head 2, intermediate 768..1535): its rows of
    q/k/v and gate/up, and its columns of o and down on whole blocks, are the dequantized rank's."""
    from test_tp_model import _as_rank

    _as_rank(monkeypatch, 1, 2, 0, 1)
    src = resolve_model(str(q8_0_default))
    cfg = model_config_from_hf(load_config(src), model=src.path, dtype=torch.bfloat16, max_model_len=64,
                               eos_token_id=2, bos_token_id=1)
    kept, dequantized = build_model(cfg, torch.device("cpu")), build_model(cfg, torch.device("cpu"))
    expected = 4 * 30 + 1 if q8_0_plan_matmul() is not None else 0   # + the (tied) embedding's vocabulary rows
    assert Q.keep_gguf_q8_0_(kept, GGUFWeightReader(src.gguf_path), None) == expected
    kept.load_weights(GGUFWeightReader(src.gguf_path))
    dequantized.load_weights(GGUFWeightReader(src.gguf_path))
    assert kept.layers[0].o_proj.in_features == 192 and kept.layers[0].down_proj.in_features == 768
    for (name, mine), whole in zip(kept.named_parameters(), dequantized.parameters()):
        if mine.dtype == torch.uint8:
            assert torch.equal(dequantize_q8_0(mine).bfloat16(), whole), name
        else:
            assert torch.equal(mine, whole), name


def _write_q8_0_tiny_gguf(path: Path) -> None:
    """A 2-layer random Llama with an untied output head, every matrix in Q8_0 with power-of-two scales."""
    from test_loader import tiny_model, write_tiny_gguf

    write_tiny_gguf(tiny_model("llama", tie=False), path, "llama",
                    matrices=lambda w: (pow2_q8_0(w), gguf.GGMLQuantizationType.Q8_0))


@needs_kernel
def test_an_untied_output_head_keeps_its_blocks_too(tmp_path):
    """The head's logits come from linear_q8_0 (float_out), the layers' from their blocks: a prefill's
    logits equal the dequantized model's where its bf16 products run linear_bf16 (AVX2), and are
    within the bf16 roundings elsewhere."""
    from kestrel.attention import CommonAttentionMetadata, PrefillSpan

    _write_q8_0_tiny_gguf(tmp_path / "tiny.gguf")
    src = resolve_model(str(tmp_path / "tiny.gguf"))
    cfg = model_config_from_hf(load_config(src), model=src.path, dtype=torch.bfloat16, max_model_len=64,
                               eos_token_id=2, bos_token_id=1)
    logits = []
    for keep in (True, False):
        model = build_model(cfg, torch.device("cpu"))
        reader = GGUFWeightReader(src.gguf_path)
        if keep:
            assert Q.keep_gguf_q8_0_(model, reader, None) == 4 * 2 + 2   # the projections, embedding and head
            assert type(model.lm_head) is Q.Q8_0Linear and type(model.embed_tokens) is Q.Q8_0Linear
        model.load_weights(reader)
        pack_linear_weights_(model)   # as the worker does: the bf16 weights into linear_bf16's panels
        Q.pack_q8_0_weights_(model)
        n = 20
        spans = [PrefillSpan(0, n, 0, np.zeros(0, dtype=np.int64))]
        common = CommonAttentionMetadata(torch.zeros(n, dtype=torch.long), 16, 0, torch.zeros((0, 0), dtype=torch.long),
                                         torch.zeros(0, dtype=torch.long), np.zeros(0, dtype=np.int64), spans)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
        hidden = model(ids, torch.arange(n), None, model.attn.build_metadata(common))
        logits.append(model.compute_logits(hidden))
    assert logits[0].dtype == torch.float32 and logits[0].shape == (20, cfg.vocab_size)
    if amx_gemv() is None and cpu_gemv() is None:
        assert torch.equal(logits[0], logits[1])
    else:
        torch.testing.assert_close(logits[0], logits[1], rtol=0.02, atol=0.05)
