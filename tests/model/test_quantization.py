"""--quantization int8 (kestrel/model/quantization.py, csrc/linear_bf16_avx512.cpp's linear_int8_amx,
csrc/linear_int8.cpp's linear_int8): the quantizer's bounds, the PyTorch reference against an
independent float64 product, the
AMX-INT8 and the AVX512-VNNI / AVX2 kernels against the reference bit for bit, the choice between them,
the projections of a model replaced, the engine the same with a kernel and without it, and the cost in
agreement on the default model (kestrel bench parity). tests/ops/test_cpu_kernels_avx2_build.py runs the
cpu_int8 tests again on the AVX2 build."""

from __future__ import annotations

import os

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.engine.arg_utils import EngineArgs
from kestrel.model import quantization as Q
from kestrel.model.layers import Linear
from kestrel.ops import cpu_gemv, cpu_kernels_isa
from kestrel.ops.dispatch import amx_gemv, int8_kernels
from kestrel.platform import cpu_flags
from tests.support.parity import save_tiny_llama, worker_of
from tests.support.skips import needs_cpu

kernels = cpu_gemv()
has_int8_kernel = kernels is not None and kernels.amx_usable()
amx_int8 = pytest.mark.skipif(not has_int8_kernel, reason=needs_cpu("AMX-INT8"))
cpu_int8 = int8_kernels()
# linear_int8 is in the AVX2 build and in the AVX-512 build where the CPU has AVX512-VNNI.
no_int8_reason = needs_cpu("AVX512-VNNI") if cpu_kernels_isa() == "avx512" else needs_cpu("AVX2")
cpu_int8_kernel = pytest.mark.skipif(cpu_int8 is None, reason=no_int8_reason)
any_int8_kernel = pytest.mark.skipif(not has_int8_kernel and cpu_int8 is None, reason=no_int8_reason)


def _int8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return Q.quantize_weight(torch.randn(n, k, generator=gen) * 0.05)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---- the quantizer and the reference ------------------------------------------------------------

def test_symmetric_int8_rounds_each_row_to_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=gen) * torch.tensor([1e-3, 0.1, 1.0, 30.0, 1e4, 0.0])[:, None]
    q, scale = Q.symmetric_int8(x.bfloat16())
    xf = x.bfloat16().float()
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert q.abs().max() <= 127
    assert torch.equal(scale, xf.abs().amax(1) / 127)
    # the largest value of each row lands on ±127; every value within half a step of its level
    assert (q[:5].abs().amax(1) == 127).all()
    assert ((q[:5].float() * scale[:5, None] - xf[:5]).abs() <= scale[:5, None] * 0.5001).all()
    assert (q[5] == 0).all() and scale[5] == 0  # a zero row


def test_reference_is_the_dequantized_product_rounded_once():
    gen = torch.Generator().manual_seed(1)
    for k in (64, 576, 2048):  # 2048: past float32's exact range, the reference sums in float64
        x = torch.randn(9, k, generator=gen).bfloat16()
        qw, ws = _int8_weight(48, k, gen)
        y = Q.linear_int8_reference(x, qw, ws)
        xq, xs = Q.symmetric_int8(Q.hadamard64(x))  # every K here is a multiple of 64: rotated
        exact = (xq.double() @ qw.double().T) * ws.double() * xs.double()[:, None]
        assert y.dtype == torch.bfloat16 and y.shape == (9, 48)
        assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()


def test_hadamard64_is_the_orthonormal_walsh_hadamard_transform_per_block():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 192, generator=gen)
    h = Q.hadamard64(x)
    sylvester = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(64)] for i in range(64)],
                             dtype=torch.float64) / 8
    expected = (x.double().view(3, 3, 64) @ sylvester).view(3, 192)
    assert (h.double() - expected).abs().max() < 1e-5
    assert (Q.hadamard64(h) - x).abs().max() < 1e-5  # its own inverse
    spike = torch.zeros(1, 64)
    spike[0, 5] = 8.0
    assert torch.equal(Q.hadamard64(spike).abs(), torch.ones(1, 64))  # an outlier spread evenly


@pytest.mark.parametrize("k", [64, 576, 1536, 96])
def test_quantized_product_is_close_to_the_full_precision_one(k):
    """Weights and activations rotated alike (or, K = 96, neither): the product barely moves. A weight
    rotated differently from its activations would give an error near 100%."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(33, k, generator=gen)
    x[:, 3] *= 40  # an outlier channel, as real hidden states have
    w = torch.randn(80, k, generator=gen) * 0.05
    qw, ws = Q.quantize_weight(w)
    exact = x.bfloat16().double() @ w.double().T
    y = Q.linear_int8(x.bfloat16(), qw, ws).double()
    assert ((y - exact).norm() / exact.norm()).item() < 0.03
    assert Q.rotates(k) == (k != 96)


def test_linear_int8_takes_any_leading_shape_a_bias_and_float32():
    gen = torch.Generator().manual_seed(2)
    qw, ws = _int8_weight(32, 96, gen)  # K = 96: not a multiple of 64, so the reference path
    bias = torch.randn(32, generator=gen)
    x = torch.randn(2, 3, 96, generator=gen)
    y = Q.linear_int8(x, qw, ws, bias)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert torch.equal(y, (Q.linear_int8_reference(x.reshape(6, 96), qw, ws) + bias).view(2, 3, 32))


def test_unknown_method_is_refused():
    assert Q.check_quantization(None) is None and Q.check_quantization("int8") == "int8"
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; choose one of int8"):
        Q.check_quantization("int4")
    with pytest.raises(ValueError, match="not supported"):
        LLM(quantization="fp8", max_model_len=64)
    assert "quantization" in EngineArgs.field_names()


# ---- the AMX-INT8 kernel ------------------------------------------------------------------------

def test_kernel_builds_where_the_cpu_has_amx_int8():
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1":   # switched off: bf16 models take the reference
        assert Q.select_int8_matmul(torch.device("cpu"), torch.bfloat16) is Q.linear_int8_reference
        return
    flags = cpu_flags()
    if {"amx_int8", "amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        assert has_int8_kernel, "the CPU has AMX-INT8 but the int8 kernel did not build or run"


@amx_int8
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32, 33, 48, 64, 65, 100, 128, 129, 300, 1000])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (16, 64), (48, 192)])
def test_kernel_matches_reference_bit_for_bit(rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    qw, ws = _int8_weight(out_f, in_f, gen)
    y = kernels.linear_int8_amx(x, qw, ws)
    assert _same_bits(y, Q.linear_int8_reference(x, qw, ws))


@amx_int8
def test_kernel_on_zero_rows_extremes_and_a_strided_x():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 256, generator=gen)
    x[3] = 0                              # a zero row: scale 0, output 0
    x[5] *= 1e30                          # large, still finite after scaling
    x[7, 11] = 500.0                      # one outlier that squeezes the rest of its row
    x[9] = -1e-30                         # tiny values
    qw, ws = _int8_weight(64, 256, gen)
    qw[10] = 0                            # a zero weight row (scale 0)
    ws[10] = 0
    for xs in (x.bfloat16(), torch.cat([x, x], dim=1).bfloat16()[:, :256]):  # contiguous and strided
        y = kernels.linear_int8_amx(xs, qw, ws)
        assert _same_bits(y, Q.linear_int8_reference(xs, qw, ws))
        assert (y[3] == 0).all() and (y[:, 10] == 0).all() and torch.isfinite(y.float()).all()


@amx_int8
def test_kernel_rejects_what_it_cannot_do():
    x, qw, ws = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernels.linear_int8_amx(torch.zeros(4, 96, dtype=torch.bfloat16), torch.zeros(16, 96, dtype=torch.int8), ws)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.linear_int8_amx(x, torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    with pytest.raises(RuntimeError, match="bf16"):
        kernels.linear_int8_amx(x.float(), qw, ws)
    with pytest.raises(RuntimeError, match="int8"):
        kernels.linear_int8_amx(x, qw.float(), ws)
    with pytest.raises(RuntimeError, match="one scale per row"):
        kernels.linear_int8_amx(x, qw, torch.ones(8))


@amx_int8
def test_dispatch_takes_the_kernel_for_bf16():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 576, generator=gen).bfloat16()
    qw, ws = _int8_weight(960, 576, gen)
    matmul = Q.select_int8_matmul(torch.device("cpu"), torch.bfloat16)
    assert matmul is not Q.linear_int8_reference
    assert Q.select_int8_matmul(torch.device("cpu"), torch.float32) is Q.linear_int8_reference
    assert _same_bits(Q.linear_int8(x, qw, ws, matmul=matmul), kernels.linear_int8_amx(x, qw, ws))


# ---- the AVX512-VNNI / AVX2 kernel (csrc/linear_int8.cpp's linear_int8) -----------------------------

def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN only has to be a NaN (its bits are torch's business)."""
    nan = torch.isnan(a.float())
    return (a.shape == b.shape and torch.equal(nan, torch.isnan(b.float()))
            and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]))


def test_cpu_int8_kernel_builds_where_the_cpu_has_it():
    if os.environ.get("KESTREL_DISABLE_CPU_KERNELS") == "1":
        assert int8_kernels() is None
        return
    isa, flags = cpu_kernels_isa(), cpu_flags()
    if isa == "avx2" or (isa == "avx512" and {"avx512_vnni", "avx512bw"} <= flags):
        assert cpu_int8 is not None, "the CPU has AVX512-VNNI or AVX2 but linear_int8 did not build or run"
        assert cpu_int8.int8_linear


@cpu_int8_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 33, 64, 65, 100, 130])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (3072, 576), (17, 64), (33, 96), (5, 3),
                                        (19, 200), (31, 2112)])
def test_cpu_int8_kernel_matches_reference_bit_for_bit(rows, out_f, in_f):
    """K of 96, 3 and 200 are not rotated (and leave a part vector at the end of each row); 2112 is past
    float32's exact sums (the reference sums in float64); N of 17, 33, 5, 19 and 31 leave part tiles."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_f + in_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    qw, ws = _int8_weight(out_f, in_f, gen)
    y = cpu_int8.linear_int8(x, qw, ws)
    assert _same_bits(y, Q.linear_int8_reference(x, qw, ws))


@cpu_int8_kernel
@pytest.mark.parametrize("rows", [1, 2])
def test_cpu_int8_kernel_reads_weights_off_a_vector_boundary_alike(rows):
    """One row reads aligned weights by non-temporal loads, others by ordinary ones: the same bits."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    qw, ws = _int8_weight(960, 576, gen)
    shifted = torch.empty(qw.numel() + 1, dtype=torch.int8)[1:].view_as(qw)
    shifted.copy_(qw)
    assert qw.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 == 1
    y = cpu_int8.linear_int8(x, qw, ws)
    assert torch.equal(cpu_int8.linear_int8(x, shifted, ws), y)
    assert _same_bits(y, Q.linear_int8_reference(x, qw, ws))


@cpu_int8_kernel
@pytest.mark.parametrize("in_f", [256, 200])
def test_cpu_int8_kernel_on_zero_rows_extremes_and_a_strided_x(in_f):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, in_f, generator=gen)
    x[3] = 0                              # a zero row: scale 0, output 0
    x[5] *= 1e30                          # large, still finite after scaling
    x[7, 11] = 500.0                      # one outlier that squeezes the rest of its row
    x[9] = -1e-30                         # tiny values
    x[11] = 1e-39                         # subnormal: 127 / max overflows to inf, levels ±127 and 0
    x[11, ::3] = 0
    x[13, :5] = torch.tensor([-1e-39, 0.0, 2e-39, 0.0, 0.0])
    x[13, 5:] = 0
    qw, ws = _int8_weight(64, in_f, gen)
    qw[10] = 0                            # a zero weight row (scale 0)
    ws[10] = 0
    qw[20] = -128                         # the one level the quantizer never makes, exact all the same
    for xs in (x.bfloat16(), torch.cat([x, x], dim=1).bfloat16()[:, :in_f]):  # contiguous and strided
        y = cpu_int8.linear_int8(xs, qw, ws)
        assert _same_bits(y, Q.linear_int8_reference(xs, qw, ws))
        assert (y[3] == 0).all() and (y[:, 10] == 0).all() and torch.isfinite(y.float()).all()


@cpu_int8_kernel
@pytest.mark.parametrize("in_f", [128, 96])
def test_cpu_int8_kernel_gives_nan_rows_where_the_reference_does(in_f):
    """A row holding a NaN or an infinity (or values whose rotation overflows) is NaN through, as the
    reference's is; the other rows are untouched."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, in_f, generator=gen).bfloat16()
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[4, 70] = float("-inf")
    x[5, :] = 3e38                        # finite, but the rotation's sums overflow
    qw, ws = _int8_weight(40, in_f, gen)
    y, ref = cpu_int8.linear_int8(x, qw, ws), Q.linear_int8_reference(x, qw, ws)
    assert _same_values(y, ref)
    assert torch.isnan(y[[1, 2, 4]].float()).all() and torch.isfinite(y[[0, 3, 6]].float()).all()


@cpu_int8_kernel
def test_cpu_int8_kernel_on_no_rows_and_what_it_refuses():
    qw, ws = _int8_weight(48, 64, torch.Generator().manual_seed(7))
    assert cpu_int8.linear_int8(torch.zeros(0, 64, dtype=torch.bfloat16), qw, ws).shape == (0, 48)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_int8.linear_int8(x.float(), qw, ws)
    with pytest.raises(RuntimeError, match="int8"):
        cpu_int8.linear_int8(x, qw.float(), ws)
    with pytest.raises(RuntimeError, match="one scale per row"):
        cpu_int8.linear_int8(x, qw, torch.ones(8))
    with pytest.raises(RuntimeError, match="disagree on K"):
        cpu_int8.linear_int8(torch.zeros(4, 32, dtype=torch.bfloat16), qw, ws)


def test_cpu_int8_selection_takes_amx_then_the_cpu_kernel_then_the_reference(monkeypatch):
    """Without AMX, bf16 models take linear_int8 (and float32 x, should one come, the reference); with
    AMX, linear_int8 takes the shapes AMX does not; float32 models and other devices the reference."""
    gen = torch.Generator().manual_seed(4)
    qw, ws = _int8_weight(100, 96, gen)     # shapes AMX cannot take
    x = torch.randn(5, 96, generator=gen)
    matmul = Q.select_int8_matmul(torch.device("cpu"), torch.bfloat16)
    assert Q.select_int8_matmul(torch.device("cpu"), torch.float32) is Q.linear_int8_reference
    assert Q.select_int8_matmul(torch.device("meta"), torch.bfloat16) is Q.linear_int8_reference
    if amx_gemv() is None and cpu_int8 is None:
        assert matmul is Q.linear_int8_reference
        return
    assert matmul is not Q.linear_int8_reference
    assert torch.equal(matmul(x, qw, ws), Q.linear_int8_reference(x, qw, ws))  # float32 x
    if cpu_int8 is None:
        return
    calls = []

    class CountingKernels:  # what int8_kernels() returns, its linear_int8 counted
        int8_linear = True

        @staticmethod
        def linear_int8(*args):
            calls.append(1)
            return cpu_int8.linear_int8(*args)

    monkeypatch.setattr(Q, "int8_kernels", lambda: CountingKernels)
    counted = Q.select_int8_matmul(torch.device("cpu"), torch.bfloat16)
    y = counted(x.bfloat16(), qw, ws)
    assert calls == [1] and _same_bits(y, Q.linear_int8_reference(x.bfloat16(), qw, ws))


# ---- the model and the engine -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    """A tiny random-weight Llama whose projections the kernel takes (K of 128 and 256)."""
    folder = tmp_path_factory.mktemp("tiny-llama-int8")
    save_tiny_llama(folder, hidden_size=128, intermediate_size=256)
    return str(folder)


def _model_of(llm: LLM):
    return worker_of(llm).model


def test_quantize_replaces_every_projection_and_nothing_else(tiny_bf16):
    llm = LLM(model=tiny_bf16, dtype="bfloat16", quantization="int8", max_model_len=256,
              kv_cache_memory=16 << 20)
    model = _model_of(llm)
    names = {n for n, m in model.named_modules() if isinstance(m, Q.Int8Linear)}
    assert names == {f"layers.{i}.{p}" for i in range(2) for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model.layers[0].gate_up_proj.qweight.shape == (512, 128)
    assert model.layers[0].gate_up_proj.qweight.dtype == torch.int8
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the embedding and the tied head stay
    assert llm.llm_engine.config.model.quantization == "int8"


@any_int8_kernel
def test_engine_gives_the_same_tokens_with_the_kernel_and_the_reference(tiny_bf16, monkeypatch, engine_check):
    """Every product is bit-identical, so whole runs are: mixed prompt lengths, chunked prefill (a
    budget of 64 tokens) and batched decode."""
    prompts = [{"prompt_token_ids": [100 + (7 * i + 3 * j) % 4000 for j in range(n)]}
               for i, n in enumerate([5, 40, 130, 17, 77, 1])]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(model=tiny_bf16, dtype="bfloat16", quantization="int8", max_model_len=256,
              kv_cache_memory=16 << 20, max_num_batched_tokens=64)
    llm = LLM(**kw)
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine_check(llm)
    del llm
    calls = []

    def counted_reference(x, qweight, scale):
        calls.append(1)
        return Q.linear_int8_reference(x, qweight, scale)

    monkeypatch.setattr(Q, "select_int8_matmul", lambda device, dtype: counted_reference)
    llm = LLM(**kw)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls, "the reference path did not run"
    assert with_kernel == reference
    assert all(len(t) == 24 for t in reference)


def test_default_model_agrees_with_bf16_mostly():
    """The cost of int8 on SmolLM2-135M (about 97% of positions, teacher-forced; see BENCHMARKS.md): a
    broken quantizer or kernel gives noise, far below this floor, and int8 without the rotation 91-93%."""
    from kestrel.bench.parity import measure
    result = measure({"quantization": "int8"}, num_prompts=6, max_tokens=32)
    assert result.sequences == 6 and result.forced_positions >= 6 * 8
    assert result.forced_agreement >= 0.9, result


def test_bench_parity_command_reports_and_appends(tmp_path, capsys):
    from kestrel.entrypoints.cli import main
    md = tmp_path / "B.md"
    assert main(["bench", "parity", "--quantization", "int8", "--num-prompts", "2", "--max-tokens", "8",
                 "--append-md", str(md)]) == 0
    text = md.read_text()
    assert "Parity of --quantization int8" in text and "teacher-forced top-1 agreement" in text
    assert "of 2 |" in text  # identical continuations out of the 2 prompts
    assert main(["bench", "parity", "--num-prompts", "1"]) == 1
    assert "pass --quantization" in capsys.readouterr().err


@any_int8_kernel
def test_kernel_bench_table_has_a_row_per_size():
    from kestrel.bench.kernels import linear_table
    table = linear_table([1, 20], calls=2, hidden=128, intermediate=256, qkv_out=256).splitlines()
    assert table[0].startswith("| rows | bf16 | int8") and len(table) == 4
    assert table[2].startswith("| 1 |") and table[3].startswith("| 20 |") and table[3].endswith("× |")
