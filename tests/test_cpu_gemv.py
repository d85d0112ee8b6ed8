"""The small-batch bf16 linear kernel (kestrel/ops/cpu_gemv.cpp) against torch, and the dispatch in
kestrel.model.layers.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.model import layers
from kestrel.ops import cpu_gemv

kernels = cpu_gemv()
pytestmark = pytest.mark.skipif(kernels is None, reason="needs a CPU with AVX512-BF16 and a C++ compiler")


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("out_f,in_f", [(960, 576), (3072, 576), (576, 1536), (49152, 576), (7, 32), (257, 64)])
def test_matches_float32_product_rounded_once(rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows * 1000 + out_f)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).bfloat16()
    y = kernels.linear_bf16_small(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
    exact = x.double() @ w.double().t()
    # float32 accumulation in another order than the exact sum, then one rounding to bf16.
    assert torch.allclose(y.double(), exact, rtol=2 ** -8, atol=1e-3 * exact.abs().max().item())
    torch_y = F.linear(x, w)
    assert (y == torch_y).float().mean() > 0.98  # the same rounding, off by one ulp at most rarely
    assert ((y.double() - torch_y.double()).abs() <= torch_y.double().abs() * 2 ** -7 + 1e-6).all()


def test_rejects_what_it_cannot_do():
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_small(torch.zeros(9, 64, dtype=torch.bfloat16), w)   # too many rows
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_small(torch.zeros(1, 48, dtype=torch.bfloat16), torch.zeros(16, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        kernels.linear_bf16_small(torch.zeros(1, 64), w)                        # float32 x


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 64])
def test_linear_dispatch_matches_torch(rows, monkeypatch):
    calls = []
    real = kernels.linear_bf16_small

    class Spy:
        def linear_bf16_small(self, x, w):
            calls.append(x.shape[0])
            return real(x, w)

    monkeypatch.setattr(layers, "cpu_gemv", lambda: Spy())
    x = torch.randn(rows, 576).bfloat16()
    w = (torch.randn(960, 576) * 0.05).bfloat16()
    y = layers.linear(x, w)
    assert ((y.double() - F.linear(x, w).double()).abs() <= F.linear(x, w).double().abs() * 2 ** -7 + 1e-6).all()
    assert calls == ([rows] if rows <= layers.SMALL_BATCH_ROWS else [])
    # float32 (the parity tests' dtype) and biased layers always take torch's path.
    layers.linear(x.float(), w.float())
    layers.linear(x, w, torch.zeros(960, dtype=torch.bfloat16))
    assert len(calls) == (1 if rows <= layers.SMALL_BATCH_ROWS else 0)
