"""cpu_kernels' linear_bf16 (bf16 products on a CPU without AVX512-BF16: the weights widened to float32
inside the kernel), in the build this CPU takes (and on the AVX2 build, through
test_cpu_kernels_avx2_build.py), against torch; the linear op and decode plan that bf16 models get from
it where cpu_gemv.cpp's kernels are not built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decode_layers_case import decode_layers_case

from kestrel.ops import cpu_gemv, cpu_kernels, dispatch

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs the compiled CPU kernels")


def _assert_like_torch(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().t()
    # float32 sums in another order than the exact sum, then one rounding to bf16.
    assert torch.allclose(y.double(), exact, rtol=2 ** -8, atol=1e-3 * exact.abs().max().item())
    torch_y = F.linear(x.float(), w.float()).bfloat16()
    assert (y == torch_y).float().mean() > 0.98  # the same rounding, off by one ulp at most rarely
    assert ((y.double() - torch_y.double()).abs() <= torch_y.double().abs() * 2 ** -7 + 1e-6).all()


# Rows on both sides of each change of path: the row stream (1..4), the dot-product tiles (5..47), the
# panels (48..) and a second block of rows (129..); K of one vector, of several pieces (1536) and an odd
# number of vectors.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 15, 16, 47, 48, 53, 128, 129, 300])
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (49152, 576), (7, 32), (257, 48), (1, 16)])
def test_matches_the_float32_product_rounded_once(rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    y = kernels.linear_bf16(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
    _assert_like_torch(y, x, w)
    widened = kernels.linear_bf16(x, w, float_out=True)
    assert widened.dtype == torch.float32 and torch.equal(widened, y.float())


def test_rows_and_columns_do_not_depend_on_the_batch_or_the_split():
    """Each output is summed in one order for 1..4 rows, in another for 5..47 and in a third from 48 rows
    up: within each range a row alone or anywhere in a batch, a column alone or in any slice of w, gives
    the same bits (so a request's tokens do not depend on its neighbours in the batch unless the batch
    crosses a range, nor on the thread count)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 1536, generator=gen).bfloat16()
    w = (torch.randn(963, 1536, generator=gen) * 0.05).bfloat16()
    few = kernels.linear_bf16(x[:4], w)
    for start, stop in [(0, 1), (1, 3), (3, 4)]:
        assert torch.equal(kernels.linear_bf16(x[start:stop], w), few[start:stop])
    some = kernels.linear_bf16(x[:47], w)
    for start, stop in [(0, 5), (10, 17), (3, 47)]:
        assert torch.equal(kernels.linear_bf16(x[start:stop], w), some[start:stop])
    full = kernels.linear_bf16(x, w)
    for start, stop in [(0, 48), (40, 100), (3, 131), (100, 300), (252, 300)]:
        assert torch.equal(kernels.linear_bf16(x[start:stop], w), full[start:stop])
    for ws in [slice(100, 117), slice(0, 1), slice(900, 963), slice(1, 3)]:
        assert torch.equal(kernels.linear_bf16(x, w[ws].contiguous()), full[:, ws])
        assert torch.equal(kernels.linear_bf16(x[:47], w[ws].contiguous()), some[:, ws])
        assert torch.equal(kernels.linear_bf16(x[:4], w[ws].contiguous()), few[:, ws])
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.linear_bf16(x, w), full)
            assert torch.equal(kernels.linear_bf16(x[:47], w), some)
            assert torch.equal(kernels.linear_bf16(x[:4], w), few)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [2, 9, 200])
def test_keeps_nan_and_inf_and_rejects_what_it_cannot_do(rows):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    w = (torch.randn(40, 64, generator=gen) * 0.05).bfloat16()
    x[0, 0], x[1, 3], x[rows - 1, 7] = float("nan"), float("inf"), float("-inf")
    y, ref = kernels.linear_bf16(x, w), F.linear(x.float(), w.float())
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert torch.equal(y[y.isinf()], ref[ref.isinf()].bfloat16())
    for bad_x, bad_w, match in [(torch.zeros(1, 12, dtype=torch.bfloat16), torch.zeros(4, 12, dtype=torch.bfloat16),
                                 "multiple of"),
                                (torch.zeros(1, 64), w, "bf16 only"),
                                (x, torch.zeros(4, 32, dtype=torch.bfloat16), "x \\[M, K\\], w \\[N, K\\]")]:
        with pytest.raises(RuntimeError, match=match):
            kernels.linear_bf16(bad_x, bad_w)


def test_linear_op_of_a_bf16_model_without_avx512_bf16():
    """Where cpu_gemv.cpp is not built (no AVX512-BF16), a bf16 model's products take linear_bf16 at every
    row count (torch's bf16 GEMM runs at a fraction of the float32 rate there), and its decode plan binds it
    with its per-thread share; elsewhere the same selection is built here by hand and checked the same way."""
    ops = dispatch._widening_bf16_linear(kernels)
    if cpu_gemv() is None:
        selected = dispatch.select_linear(torch.device("cpu"), torch.bfloat16)
        assert selected.plan_matmul == ops.plan_matmul
    plan = ops.plan_matmul
    assert plan.kernel is kernels.linear_bf16 and plan.dtype == torch.bfloat16 and plan.k_multiple == kernels.lanes
    assert plan.address == kernels.matmul_address("linear_bf16") != kernels.matmul_address("linear_f32")
    assert plan.slice_address == kernels.matmul_slice_address("linear_bf16") != 0
    gen = torch.Generator().manual_seed(0)
    w, bias = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16(), torch.randn(960, generator=gen).bfloat16()
    for rows in (1, 7, 600):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        assert torch.equal(ops.linear(x, w), kernels.linear_bf16(x, w))
        assert torch.equal(ops.linear_to_float(x, w), kernels.linear_bf16(x, w, float_out=True))
        assert torch.equal(ops.linear(x, w, bias), F.linear(x, w, bias))  # a bias: torch's rounding
    # float32 products are not this kernel's
    x = torch.randn(3, 576, generator=gen)
    assert torch.equal(ops.linear(x, w.float()), F.linear(x, w.float()))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 3, 5, 15, 16])
def test_decode_layers_in_one_region_per_layer_match_the_kernel_by_kernel_loop(rows, threads):
    """DecodeLayers on linear_bf16's per-thread shares (1..15 rows: a layer in three parallel regions)
    against the same loop calling the whole linear_bf16 per kernel, bit for bit, the K/V written included."""
    case = decode_layers_case(rows, torch.bfloat16, heads=6, kv_heads=2, head_dim=64, hidden=320, inter=416,
                              layers=3, seed=rows)
    address = kernels.matmul_address("linear_bf16")
    per_kernel_caches = [c.clone() for c in case.caches]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # both under the same threads: decode attention splits long contexts by them
    try:
        per_kernel = kernels.DecodeLayers(case.weights, per_kernel_caches, case.heads, 1e-5, case.scale, address)(
            case.x.clone(), *case.step_args())
        slice_address = kernels.matmul_slice_address("linear_bf16")
        in_regions = kernels.DecodeLayers(case.weights, case.caches, case.heads, 1e-5, case.scale, address,
                                          slice_address)(case.x.clone(), *case.step_args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(in_regions, per_kernel)
    assert all(torch.equal(a, b) for a, b in zip(case.caches, per_kernel_caches))
    with pytest.raises(RuntimeError, match="no slice"):
        kernels.matmul_slice_address("linear_f32")
