"""The small-batch bf16 linear kernels (kestrel/ops/csrc/linear_bf16_avx512.cpp: AVX512-BF16 and AMX) against torch,
and the linear op selected for bf16 models (kestrel/ops/dispatch.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.ops import cpu_gemv, dispatch
from tests.support.decode_layers_case import decode_layers_case
from tests.support.skips import needs_cpu

kernels = cpu_gemv()
pytestmark = pytest.mark.skipif(kernels is None, reason=needs_cpu("AVX512-BF16"))


def _assert_like_torch(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    # float32 accumulation in another order than the exact sum, then one rounding to bf16.
    assert torch.allclose(y.double(), exact, rtol=2 ** -8, atol=1e-3 * exact.abs().max().item())
    torch_y = F.linear(x, w)
    assert (y == torch_y).float().mean() > 0.98  # the same rounding, off by one ulp at most rarely
    assert ((y.double() - torch_y.double()).abs() <= torch_y.double().abs() * 2 ** -7 + 1e-6).all()


def _assert_sums_in_float32(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y: float32 sums of the exact products (bf16 x bf16 products are exact in float32), K of them: within
    K float32 roundings of the exact sum, far inside a bf16 step."""
    exact = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * x.shape[1] * 2 ** -24
    assert ((y.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 15, 16, 17, 31, 48, 64, 65, 127, 128])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (49152, 576), (7, 32), (257, 64), (17, 96)])
def test_avx512_matches_float32_product_rounded_once(rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    y = kernels.linear_bf16_avx512(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
    _assert_like_torch(y, x, w)
    # float_out: the float32 sums y was rounded from (the output head's logits are never rounded to bf16)
    widened = kernels.linear_bf16_avx512(x, w, float_out=True)
    assert widened.dtype == torch.float32 and torch.equal(widened.bfloat16(), y)
    _assert_sums_in_float32(widened, x, w)


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_avx512_weights_off_a_cache_line_give_the_same_bits(rows):
    """1-2 rows stream 64-byte aligned weights past the cache (non-temporal loads) and read others
    with ordinary loads: the same sums either way."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    shifted = torch.empty(w.numel() + 1, dtype=torch.bfloat16)[1:].view_as(w)  # 2 bytes off the line
    shifted.copy_(w)
    assert w.data_ptr() % 64 == 0 and shifted.data_ptr() % 64 == 2
    y = kernels.linear_bf16_avx512(x, w)
    assert torch.equal(kernels.linear_bf16_avx512(x, shifted), y)
    _assert_like_torch(y, x, w)


def test_avx512_rows_do_not_depend_on_the_batch():
    """Each output is one row of x against one row of w, summed in one order for batches of 1-15 rows
    and in one (other) order for 16-128: within each range a row alone, or at any place in a batch of
    any size, gives the same bits (so a request's tokens do not depend on its neighbours in the batch
    unless the batch crosses 16 rows)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(77, 576, generator=gen).bfloat16()
    w = (torch.randn(963, 576, generator=gen) * 0.05).bfloat16()
    few = kernels.linear_bf16_avx512(x[:15], w)
    for start, stop in [(0, 1), (5, 7), (10, 13), (2, 10)]:
        assert torch.equal(kernels.linear_bf16_avx512(x[start:stop], w), few[start:stop])
    full = kernels.linear_bf16_avx512(x, w)
    for start, stop in [(0, 16), (40, 77), (3, 67), (20, 53), (60, 77)]:
        assert torch.equal(kernels.linear_bf16_avx512(x[start:stop], w), full[start:stop])
    for ws in [slice(100, 117), slice(48, 96), slice(0, 1), slice(900, 963)]:
        assert torch.equal(kernels.linear_bf16_avx512(x, w[ws].contiguous()), full[:, ws])
        assert torch.equal(kernels.linear_bf16_avx512(x[:15], w[ws].contiguous()), few[:, ws])


@pytest.mark.parametrize("rows", [9, 40])
def test_avx512_keeps_nan_and_inf_and_rejects_what_it_cannot_do(rows):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    w = (torch.randn(40, 64, generator=gen) * 0.05).bfloat16()
    x[3, 0], x[5, 0], x[rows - 1, 7] = float("nan"), float("inf"), float("-inf")
    y, ref = kernels.linear_bf16_avx512(x, w), F.linear(x, w)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    for bad_x, bad_w in [(torch.zeros(129, 64, dtype=torch.bfloat16), w),          # too many rows
                         (torch.zeros(1, 48, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16)),
                         (torch.zeros(1, 64), w)]:                                   # float32 x
        with pytest.raises(RuntimeError):
            kernels.linear_bf16_avx512(bad_x, bad_w)


amx = pytest.mark.skipif(kernels is None or not kernels.amx_usable(), reason=needs_cpu("AMX-BF16"))


@amx
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (3072, 576), (576, 1536), (49152, 576), (16, 32), (48, 96)])
def test_amx_matches_float32_product_rounded_once(rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    y = kernels.linear_bf16_amx(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
    _assert_like_torch(y, x, w)


@amx
def test_amx_takes_strided_rows_and_keeps_nan_and_inf():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 128, generator=gen).bfloat16()
    w = (torch.randn(64, 64, generator=gen) * 0.05).bfloat16()
    view = x[:, :64]                                        # not contiguous: the kernel copies it
    _assert_like_torch(kernels.linear_bf16_amx(view, w), view.contiguous(), w)
    special = x[:, :64].contiguous()
    special[3, 0], special[5, 0] = float("nan"), float("inf")
    y = kernels.linear_bf16_amx(special, w)
    ref = F.linear(special, w)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())


@amx
def test_amx_rejects_what_it_cannot_do():
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_amx(torch.zeros(129, 64, dtype=torch.bfloat16), w)  # too many rows
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_amx(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_amx(torch.zeros(1, 48, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_amx(torch.zeros(1, 64), w)                            # float32 x


@pytest.mark.parametrize("use_amx", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 64, 65, 128, 129])
@pytest.mark.parametrize("out_f", [960, 200])
def test_linear_dispatch_matches_torch(rows, out_f, use_amx):
    calls = []

    class Spy:
        def linear_bf16_avx512(self, x, w, float_out=False):
            calls.append(("avx512", x.shape[0]))
            return kernels.linear_bf16_avx512(x, w, float_out=float_out)

        def linear_bf16_amx(self, x, w, float_out=False):
            calls.append(("amx", x.shape[0]))
            return kernels.linear_bf16_amx(x, w, float_out) if kernels.amx_usable() else F.linear(x, w)

        def matmul_address(self, name):
            return kernels.matmul_address(name)

        def matmul_slice_address(self, name):
            return kernels.matmul_slice_address(name)

    linear = (dispatch._amx_linear(Spy()) if use_amx else dispatch._avx512_bf16_linear(Spy())).linear
    x = torch.randn(rows, 576).bfloat16()
    w = (torch.randn(out_f, 576) * 0.05).bfloat16()
    y = linear(x, w)
    assert ((y.double() - F.linear(x, w).double()).abs() <= F.linear(x, w).double().abs() * 2 ** -7 + 1e-6).all()
    if use_amx and rows <= dispatch.AMX_MAX_ROWS:
        expected = [("amx" if out_f % 16 == 0 else "avx512", rows)]   # N off the AMX tiles: AVX512-BF16
    elif not use_amx and rows <= dispatch.AVX512_MAX_ROWS:
        expected = [("avx512", rows)]
    else:
        expected = []
    assert calls == expected
    # float32, biased layers and widths the kernels cannot tile always take torch's path.
    linear(x.float(), w.float())
    linear(x, w, torch.zeros(out_f, dtype=torch.bfloat16))
    linear(x[:, :48].contiguous(), w[:, :48].contiguous())
    assert calls == expected


def test_bf16_models_take_the_amx_linear_where_amx_runs(monkeypatch):
    ops = dispatch.select_linear(torch.device("cpu"), torch.bfloat16)
    amx_plan = dispatch.amx_gemv() is not None
    assert ops.plan_matmul is not None and (ops.plan_matmul.n_multiple == 16) == amx_plan
    monkeypatch.setenv("KESTREL_DISABLE_AMX", "1")
    plan_matmul = dispatch.select_linear(torch.device("cpu"), torch.bfloat16).plan_matmul
    assert plan_matmul is not None and plan_matmul.n_multiple == 1     # the AVX512-BF16 kernel's plan
    assert dispatch.select_linear(torch.device("meta"), torch.bfloat16).linear is F.linear


@amx
@pytest.mark.parametrize("rows", [1, 9, 48, 128])
def test_amx_float_out_is_the_float32_sums_before_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    w = (torch.randn(4096, 576, generator=gen) * 0.05).bfloat16()
    y = kernels.linear_bf16_amx(x, w, float_out=True)
    assert y.dtype == torch.float32 and torch.equal(y.bfloat16(), kernels.linear_bf16_amx(x, w))
    _assert_sums_in_float32(y, x, w)
    ops = dispatch.select_linear(torch.device("cpu"), torch.bfloat16)
    assert torch.equal(ops.linear_to_float(x, w), y)
    # float32 inputs (the parity tests) keep torch's path
    assert torch.equal(ops.linear_to_float(x.float(), w.float()), F.linear(x.float(), w.float()))


def test_matmul_address_names_each_matmul_of_the_module():
    """The plan's C++ layer loop calls the bf16 matmuls by these addresses (DecodeLayers); one module
    holds every matmul of its build, each at an address of its own, and no other name."""
    names = ("linear_bf16_avx512", "linear_bf16_amx", "linear_bf16", "linear_f32", "linear_gguf")
    addresses = [kernels.matmul_address(name) for name in names]
    assert len(set(addresses)) == len(names) and 0 not in addresses
    with pytest.raises(RuntimeError, match="no matmul"):
        kernels.matmul_address("linear_bf16_avx512_packed")


def test_matmul_slice_address_names_only_the_avx512_matmul():
    """The C++ layer loop's per-thread shares exist for the AVX512-BF16 matmul's 1..15-row path only (the
    AMX kernel sums in another order, which the shares would not reproduce)."""
    assert kernels.matmul_slice_address("linear_bf16_avx512") != 0
    for name in ("linear_bf16_amx", "linear_f32"):
        with pytest.raises(RuntimeError, match="no slice"):
            kernels.matmul_slice_address(name)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 15, 16])
def test_decode_layers_in_one_region_per_layer_match_the_kernel_by_kernel_loop(rows, threads):
    """cpu_kernels' DecodeLayers on the slice matmul (1..15 rows: a layer in three parallel regions, each
    thread computing its share of every projection) against the same loop calling the whole matmul per
    kernel, bit for bit, the K/V written included; from 16 rows both call the whole matmul. Three threads
    split the 16-column blocks unevenly."""
    from kestrel.ops import cpu_kernels
    loop = cpu_kernels()
    case = decode_layers_case(rows, torch.bfloat16, heads=6, kv_heads=2, head_dim=64, hidden=320, inter=416,
                              layers=3, seed=rows)
    address = kernels.matmul_address("linear_bf16_avx512")
    per_kernel_caches = [c.clone() for c in case.caches]
    before = torch.get_num_threads()
    # Both under the same threads: the decode attention splits long contexts by the thread count.
    torch.set_num_threads(threads)
    try:
        per_kernel = loop.DecodeLayers(case.weights, per_kernel_caches, case.heads, 1e-5, case.scale, address)(
            case.x.clone(), *case.step_args())
        in_regions = loop.DecodeLayers(case.weights, case.caches, case.heads, 1e-5, case.scale, address,
                                       kernels.matmul_slice_address("linear_bf16_avx512"))(
            case.x.clone(), *case.step_args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(in_regions, per_kernel)
    assert all(torch.equal(a, b) for a, b in zip(case.caches, per_kernel_caches))
    assert torch.isfinite(in_regions.float()).all() and in_regions.float().abs().max() > 0


def test_decode_layers_in_regions_report_a_kernel_error_after_the_region():
    """An error inside the parallel region (here the rotary kernel's shape check, on thread 0) comes out
    as the kernel's RuntimeError, not an abort, and the loop runs again afterwards."""
    from kestrel.ops import cpu_kernels
    loop = cpu_kernels()
    case = decode_layers_case(1, torch.bfloat16, heads=2, kv_heads=1, head_dim=64, hidden=128, inter=64, layers=1,
                              seed=0)
    layers = loop.DecodeLayers(case.weights, case.caches, case.heads, 1e-5, case.scale,
                               kernels.matmul_address("linear_bf16_avx512"),
                               kernels.matmul_slice_address("linear_bf16_avx512"))
    with pytest.raises(RuntimeError):   # cos and sin of half the head size
        layers(case.x.clone(), case.cos[:, :32], case.sin[:, :32], *case.step_args()[2:])
    ok = layers(case.x.clone(), *case.step_args())
    assert ok.shape == (1, 128) and torch.isfinite(ok.float()).all()


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (3072, 576), (576, 1536), (49152, 576), (32, 64)])
def test_packed_weights_give_a_row_the_same_bits_at_every_row_count(out_f, in_f):
    """Batch invariance: on weights packed as the model's are (pack_bf16_weight), each output is its row's
    pairs summed in K order at every row count, so a row gives the same bits alone, in any batch, in a
    chunk of a prompt of any length: the bits the rows-in-lanes path gives from 16 rows on [N, K]."""
    gen = torch.Generator().manual_seed(out_f + in_f)
    x = torch.randn(300, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    packed = dispatch.pack_bf16_weight(w, 16, 32)
    assert packed is not None and packed.shape == (out_f // 16, in_f, 16)
    full = kernels.linear_bf16_avx512(x, packed, float_out=True)
    assert torch.equal(kernels.linear_bf16_avx512(x, packed), full.bfloat16())
    _assert_sums_in_float32(full, x, w)
    assert torch.equal(kernels.linear_bf16_avx512(x[:128], w, float_out=True), full[:128])   # the lanes path
    for start, stop in [(0, 1), (7, 8), (0, 2), (3, 6), (5, 12), (0, 15), (0, 17), (40, 88), (100, 300)]:
        assert torch.equal(kernels.linear_bf16_avx512(x[start:stop], packed, float_out=True), full[start:stop])


def test_the_linear_op_runs_packed_weights_on_the_kernel_at_every_row_count():
    ops = dispatch.select_linear(torch.device("cpu"), torch.bfloat16)
    assert ops.pack_weight is not None and ops.plan_matmul.packed_slice_address
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(960, generator=gen).bfloat16()
    packed = ops.pack_weight(w)
    assert packed is not None and ops.pack_weight(w[:7].contiguous()) is None
    for rows in (1, 7, 16, 600):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        y = kernels.linear_bf16_avx512(x, packed)
        assert torch.equal(ops.linear(x, packed), y)
        assert torch.equal(ops.linear(x, packed, bias), y + bias)
        assert torch.equal(ops.linear(x.view(1, rows, 576), packed), y.view(1, rows, 960))
        assert torch.equal(ops.linear_to_float(x, packed), kernels.linear_bf16_avx512(x, packed, float_out=True))
