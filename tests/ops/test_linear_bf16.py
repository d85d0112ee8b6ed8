"""cpu_kernels' linear_bf16 (bf16 products on a CPU without AVX512-BF16: the weights widened to float32
inside the kernel), in the build this CPU takes (and on the AVX2 build, through
test_cpu_kernels_avx2_build.py), against torch; the linear op and decode plan that bf16 models get from
it where the AVX512-BF16 kernels are not built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.ops import cpu_gemv, cpu_kernels, dispatch
from tests.support.decode_layers_case import decode_layers_case
from tests.support.skips import needs_cpu

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason=needs_cpu("AVX2"))


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
    widened = kernels.linear_bf16(x, w, float_out=True)   # the float32 sums y was rounded from
    assert widened.dtype == torch.float32 and torch.equal(widened.bfloat16(), y)


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
    """Where the AVX512-BF16 kernels are not built (no AVX512-BF16), a bf16 model's products take linear_bf16 at every
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


def _packed(w: torch.Tensor) -> torch.Tensor:
    packed = dispatch.pack_bf16_weight(w, kernels.panel_columns, kernels.lanes)
    assert packed is not None
    return packed


def test_packing_lays_out_panels_of_16_columns_in_interleaved_halves():
    assert kernels.panel_columns == 16
    w = torch.arange(48 * 32, dtype=torch.float32).view(48, 32).bfloat16()
    packed = _packed(w)
    assert packed.shape == (3, 32, 16) and packed.is_contiguous()
    # each k-row holds columns 0, 8, 1, 9, ..., 7, 15 of its panel
    for p, k, c in [(0, 0, 0), (1, 5, 3), (2, 31, 15), (0, 7, 8), (2, 2, 7)]:
        assert packed[p, k, 2 * (c % 8) + c // 8] == w[16 * p + c, k]
    assert torch.equal(dispatch.packed_bf16_rows(packed, torch.arange(48)), w)
    # what the kernel cannot read packed stays as it is
    for bad in [torch.zeros(40, 32, dtype=torch.bfloat16), torch.zeros(48, 12, dtype=torch.bfloat16),
                torch.zeros(48, 32), torch.zeros(0, 32, dtype=torch.bfloat16)]:
        assert dispatch.pack_bf16_weight(bad, 16, kernels.lanes) is None


@pytest.mark.parametrize("out_f,in_f", [(960, 576), (576, 1536), (48, 16), (256, 48)])
def test_packed_weights_give_every_row_alike_whatever_the_batch(out_f, in_f):
    """On packed weights every output is one sum down k per piece of K whatever the row count: a row gives
    the same bits alone, anywhere in a batch of any size, in any slice of the columns and under any thread
    count; from 48 rows (where the [N, K] weights take the panel tile) the two layouts agree bit for bit."""
    gen = torch.Generator().manual_seed(out_f + in_f)
    x = torch.randn(300, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    packed = _packed(w)
    full = kernels.linear_bf16(x, packed)
    assert full.shape == (300, out_f)
    _assert_like_torch(full, x, w)
    assert torch.equal(full, kernels.linear_bf16(x, w))
    assert torch.equal(kernels.linear_bf16(x, packed, float_out=True).bfloat16(), full)
    for start, stop in [(0, 1), (7, 8), (0, 2), (3, 6), (5, 12), (0, 17), (40, 88), (100, 300), (1, 300)]:
        assert torch.equal(kernels.linear_bf16(x[start:stop], packed), full[start:stop]), (start, stop)
    panels = slice(1, 2) if out_f < 64 else slice(2, 7)
    cols = slice(panels.start * 16, panels.stop * 16)
    for rows in (1, 6, 300):
        assert torch.equal(kernels.linear_bf16(x[:rows], packed[panels].contiguous()), full[:rows, cols])
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.linear_bf16(x, packed), full)
            assert torch.equal(kernels.linear_bf16(x[:5], packed), full[:5])
    finally:
        torch.set_num_threads(before)


def test_packed_weights_keep_nan_and_inf_and_reject_a_bad_layout():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    w = (torch.randn(32, 64, generator=gen) * 0.05).bfloat16()
    x[0, 0], x[1, 3], x[8, 7] = float("nan"), float("inf"), float("-inf")
    y, ref = kernels.linear_bf16(x, _packed(w)), F.linear(x.float(), w.float())
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    with pytest.raises(RuntimeError, match="packed"):
        kernels.linear_bf16(x, torch.zeros(2, 64, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed"):
        kernels.linear_bf16(x, torch.zeros(2, 32, 16, dtype=torch.bfloat16))


def test_linear_op_packs_weights_and_reads_them():
    """The widening op family packs a layer's weight after loading (pack_weight) and reads it packed in
    every call: rows of any count, a bias, x of more dimensions, float logits."""
    ops = dispatch._widening_bf16_linear(kernels)
    assert ops.pack_weight is not None
    if cpu_gemv() is None:
        assert dispatch.select_ops(torch.device("cpu"), torch.bfloat16).pack_weight is not None
    gen = torch.Generator().manual_seed(1)
    w, bias = (torch.randn(960, 576, generator=gen) * 0.05).bfloat16(), torch.randn(960, generator=gen).bfloat16()
    packed = ops.pack_weight(w)
    assert packed is not None and packed.shape == (60, 576, 16)
    assert ops.pack_weight(w[:7].contiguous()) is None
    for rows in (1, 7, 600):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        y = kernels.linear_bf16(x, packed)
        assert torch.equal(ops.linear(x, packed), y)
        assert torch.equal(ops.linear(x, packed, bias), y + bias)
        assert torch.equal(ops.linear(x.view(1, rows, 576), packed), y.view(1, rows, 960))
        assert torch.equal(ops.linear_to_float(x, packed), kernels.linear_bf16(x, w, float_out=True)
                           if rows >= 48 else kernels.linear_bf16(x, packed, float_out=True))


def test_a_packed_embedding_table_gives_the_same_rows():
    """A tied output head is packed with the embedding table it is: token lookups read it packed."""
    from kestrel.model.layers import embedding_rows
    table = torch.randn(96, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids = torch.tensor([0, 95, 17, 16, 15, 17, 40])
    assert torch.equal(embedding_rows(_packed(table), ids), F.embedding(ids, table))
    assert torch.equal(embedding_rows(table, ids), F.embedding(ids, table))
    assert embedding_rows(_packed(table), ids[:0]).shape == (0, 48)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 3, 5, 15, 16])
def test_decode_layers_on_packed_weights_match_the_kernel_by_kernel_loop(rows, threads):
    """The same for packed projections, on the packed per-thread share."""
    case = decode_layers_case(rows, torch.bfloat16, heads=6, kv_heads=2, head_dim=64, hidden=320, inter=416,
                              layers=3, seed=rows)
    weights = [_packed(w) if i % 6 not in (0, 3) else w for i, w in enumerate(case.weights)]
    address = kernels.matmul_address("linear_bf16")
    per_kernel_caches = [c.clone() for c in case.caches]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        per_kernel = kernels.DecodeLayers(weights, per_kernel_caches, case.heads, 1e-5, case.scale, address)(
            case.x.clone(), *case.step_args())
        in_regions = kernels.DecodeLayers(weights, case.caches, case.heads, 1e-5, case.scale, address,
                                          kernels.matmul_slice_address("linear_bf16_packed"))(
            case.x.clone(), *case.step_args())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(in_regions, per_kernel)
    assert all(torch.equal(a, b) for a, b in zip(case.caches, per_kernel_caches))
    mixed = list(weights)
    mixed[2] = case.weights[2]
    with pytest.raises(RuntimeError, match="all packed or none"):
        kernels.DecodeLayers(mixed, case.caches, case.heads, 1e-5, case.scale, address)


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
