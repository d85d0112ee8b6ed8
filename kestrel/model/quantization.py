"""--quantization int8: the decoder layers' projections in int8, quantized at load time from the
checkpoint's weights (no calibration, no quantized checkpoint needed).

Weights: symmetric int8 with one float32 scale per output row (max |w| / 127). Activations: each token's
row is quantized the same way at every product (dynamic, per token), so the matrix products run as
int8 × int8 summed exactly in int32; y = (acc × weight scale) × token scale, rounded once to the model
dtype. This is the W8A8 scheme of llama.cpp's Q8_0 products and vLLM's CPU int8 path: weight-only int8
was measured slower here, because widening int8 to bf16 costs more than the bytes it saves.

The embedding, the output head and the norms stay in the model dtype (as vLLM leaves lm_head
unquantized by default). On CPUs with AMX-INT8 the products run in cpu_gemv.cpp's linear_int8_amx;
elsewhere `linear_int8_reference`, which gives bit-identical results, runs in PyTorch.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kestrel.model.layers import Linear, _amx_usable
from kestrel.ops import cpu_gemv

QUANTIZATION_METHODS = ("int8",)

# Up to this K, |sum of K products of two int8 in [-127, 127]| < 2^24, so float32 sums them exactly.
_FLOAT32_EXACT_K = (1 << 24) // (127 * 127)


def check_quantization(method: str | None) -> str | None:
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)} "
                     f"or leave it unset")


def symmetric_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [rows, K] as int8 and a float32 scale: q = round_half_even(x × (127 / max|x|)),
    scale = max|x| / 127; a row of zeros gets q = 0, scale = 0. (127 / max is divided, not taken as
    a reciprocal times 127: the kernel divides, and the two can differ in the last bit.)"""
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    q = (xf * inv[:, None]).round().clamp_(-127, 127).to(torch.int8)
    return q, absmax / 127.0


def linear_int8_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What linear_int8_amx computes, in PyTorch: x [M, K] quantized per row, exact integer sums,
    (acc × scale[n]) × x_scale[m] in float32, rounded once to x's dtype."""
    xq, x_scale = symmetric_int8(x)
    exact = torch.float32 if qweight.shape[1] <= _FLOAT32_EXACT_K else torch.float64
    acc = (xq.to(exact) @ qweight.to(exact).T).float()
    return ((acc * scale) * x_scale[:, None]).to(x.dtype)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized(qweight)^T (+ bias), with x quantized per token."""
    if x.dim() != 2:
        return linear_int8(x.reshape(-1, x.shape[-1]), qweight, scale, bias).view(*x.shape[:-1], qweight.shape[0])
    kernels = _int8_kernels(x, qweight)
    y = kernels.linear_int8_amx(x, qweight, scale) if kernels is not None else linear_int8_reference(x, qweight, scale)
    return y if bias is None else y + bias


def _int8_kernels(x: torch.Tensor, qweight: torch.Tensor):
    """cpu_gemv's AMX-INT8 kernel if it can take this product (bf16 on CPU, K % 64 == 0, N % 16 == 0)."""
    if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[0] >= 1 and x.shape[1] % 64 == 0
            and qweight.shape[0] % 16 == 0):
        return _amx_int8_module()
    return None


@functools.cache
def _amx_int8_module():
    kernels = cpu_gemv()
    return kernels if kernels is not None and _amx_usable(kernels) else None


class Int8Linear(nn.Module):
    """A Linear with its weight held as int8 rows and a float32 scale per row."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        qweight, scale = symmetric_int8(linear.weight.data)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_int8(x, self.qweight, self.scale, self.bias)


def quantize_model_(model: nn.Module, method: str | None) -> int:
    """Replace every decoder projection (`Linear`) of a loaded model by its quantized form, in place;
    the number replaced. The full-precision weights are dropped."""
    if check_quantization(method) is None:
        return 0
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module))
    return len(targets)
