"""Which implementation of each op family a model runs: decided once, from the device, the dtype and
what the compiled kernels offer (vLLM's CustomOp idea: pick the forward when the op is built, not
when it is called).

Families: RMSNorm (alone and fused with the residual add), SiLU-and-mul, rotary embedding, the
linear layer (and the output head's float logits), argmax over rows. `select_ops` returns one `Ops`
for a (device, dtype); model code calls its members and never asks whether a kernel exists. The
references here follow Hugging Face's arithmetic (norms and activations in float32, rotary with
`rotate_half`), so float32 runs match `transformers`.

Two forms of each op. The generic members (`Ops.rms_norm`, `Ops.linear`, ...) take any tensors and check
each call against what the kernel takes (the tests and benchmarks call them so). The bound forms
(`Ops.norm_for(dim)`, `Ops.linear_for(weight, bias)`, ...) are what a model calls: everything that
depends only on what is fixed when the model is built (device, dtype, row length, head size, a
weight's shape, dtype, layout and bias) is decided once, when the layer is built or its weights are
final, and returns either the kernel or the reference. What is left per call is what the batch
decides: the number of rows (one comparison, where a kernel takes a bounded number) and, for the
norms and the activation, the layout of the tensor the call passes (a view takes the reference). A
bound op takes the model's activations: 2-D [rows, width] in the model's dtype (rotary: qkv
[tokens, heads, head_dim], contiguous, with cos/sin tables in the model's dtype). For the inputs a
model passes, both forms choose the same kernel.

The int8 matmul of --quantization int8 is chosen the same way in kestrel/model/quantization.py, the
rotary + KV-cache write and attention by the attention backend (kestrel/attention).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kestrel.ops import amx_disabled, cpu_gemv, cpu_kernels, linear_f32_preferred
from kestrel.ops.gguf_blocks import GGUF_PANEL

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
AddRmsNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
Activation = Callable[[torch.Tensor], torch.Tensor]
Rotary = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], None]
Linear = Callable[..., torch.Tensor]          # (x, weight, bias=None) -> y
PackWeight = Callable[[torch.Tensor], torch.Tensor | None]   # weight [N, K] -> the layout `linear` reads fastest
LinearToFloat = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Argmax = Callable[[torch.Tensor], torch.Tensor]
LinearFor = Callable[[torch.Tensor, torch.Tensor | None], Linear]   # (weight, bias) -> the op for that weight
LinearToFloatFor = Callable[[torch.Tensor], LinearToFloat]           # weight -> the head's op for that weight

# Up to this many rows a bf16 linear layer streams its weights through the AMX kernel
# (csrc/linear_bf16_avx512.cpp), faster than torch's GEMM at every size up to it; prefill chunks above it
# go to torch's GEMM, which reaches the AMX rate there (the figures behind these bounds: docs/kernels.md).
AMX_MAX_ROWS = 128
# Without AMX (AVX512-BF16 only, as AMD Zen 4): linear_bf16_avx512 up to this many rows on [N, K]
# weights (all it takes), faster than torch's bf16 GEMM at every such size; packed weights take it at
# every row count.
AVX512_MAX_ROWS = 128
# Float32 (no bf16 on AVX2 machines): the small-batch kernel (linear_f32) up to this many rows, where it
# is faster than torch's GEMM reading the weights from memory; prefill chunks beyond it go to torch's GEMM.
F32_MAX_ROWS = 128
# bf16 without AVX512-BF16 (linear_bf16, which takes every row count): the decode plan covers steps of
# up to this many rows, as on the other bf16 kernels.
WIDENING_BF16_PLAN_ROWS = 128


# ---- the PyTorch references -------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, round to the input dtype, then scale (Hugging Face's order)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dim with `weight` = 1 + w in float32, as Hugging Face computes it:
    the product taken in float32 and rounded once (Llama's rounds the normalised x first)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_reference(residual, weight, eps), residual


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x = gate | up along the last dim → silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] (Hugging Face's rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_reference(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the q and k heads of qkv [tokens, num_heads + 2 kv_heads, head_dim] in place: their first
    cos.shape[-1] dimensions (all of them, or a partial rotary's share, Phi-4's), the rest as they are."""
    num_kv_heads = (qkv.shape[1] - num_heads) // 2
    qk = qkv[:, :num_heads + num_kv_heads, :cos.shape[-1]]
    qk.copy_(apply_rotary(qk, cos, sin))


def argmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def linear_to_float_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T as float32 sums, never rounded to a narrower dtype on the way (the output head: logits
    rounded to bf16 tie where the reference's float32 ones differ)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float())


def float_out_in_row_chunks(kernel: Callable[..., torch.Tensor], max_rows: int, x: torch.Tensor,
                            weight: torch.Tensor) -> torch.Tensor:
    """kernel(x, weight, float_out=True) on pieces of at most `max_rows` rows of x (a kernel that takes
    no more), concatenated: each row's logits are the same whichever piece it falls in."""
    if x.shape[0] <= max_rows:
        return kernel(x, weight, float_out=True)
    return torch.cat([kernel(part, weight, float_out=True) for part in x.split(max_rows)])


# ---- what the compiled kernels offer -----------------------------------------------------------

def elementwise_kernels(device: torch.device, dtype: torch.dtype):
    """cpu_kernels() where its norm, activation and rotary kernels serve this model (a CPU model in
    float32 or bf16, a build of the kernels), else None."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return cpu_kernels()


def amx_gemv():
    """cpu_gemv() where its AMX kernels (bf16 and int8 matmuls) can run, else None."""
    gemv = cpu_gemv()
    if gemv is None or amx_disabled() or not gemv.amx_usable():
        return None
    return gemv


def int8_kernels():
    """cpu_kernels() where its build has the int8 matmul (linear_int8: AVX512-VNNI or AVX2), else None."""
    kernels = cpu_kernels()
    if kernels is None or not kernels.int8_linear:
        return None
    return kernels


@dataclass(frozen=True)
class F32Kernels:
    """The float32 matmul of a kernel build, and its address for the C++ decode layer loop."""
    linear_f32: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    address: int


def f32_kernels() -> F32Kernels | None:
    """The float32 small-batch matmul (linear_f32) and its address, where float32 products
    should take them (ops.linear_f32_preferred: the AVX2 build; on AVX-512 torch's GEMM stays faster at
    most shapes); None elsewhere. Every caller takes the answer from here."""
    if not linear_f32_preferred():
        return None
    kernels = cpu_kernels()
    return F32Kernels(kernels.linear_f32, kernels.matmul_address("linear_f32"))


# ---- the families ------------------------------------------------------------------------------

def width_for_kernel(width: int) -> bool:
    """Build time: whether the elementwise kernels (norm, activation, rotary) take rows of `width`
    values: a multiple of 32 (the AVX-512 build's two vectors; the AVX2 build's four)."""
    return width % 32 == 0


def _kernel_layout(x: torch.Tensor) -> bool:
    """Per call: whether `x` is laid out as the elementwise kernels read it, 2-D and contiguous (the
    strided q/k heads of qkv are not; they take the reference)."""
    return x.dim() == 2 and x.is_contiguous()


def _rows_for_kernel(x: torch.Tensor) -> bool:
    """Whether the elementwise kernels take `x` (the generic ops' check of each call): 2-D, contiguous,
    float32/bf16, rows of a width they take."""
    return (x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16) and width_for_kernel(x.shape[-1])
            and x.is_contiguous())


def select_norm(device: torch.device, dtype: torch.dtype, dim: int | None = None) -> tuple[RmsNorm, AddRmsNorm]:
    """(rms_norm(x, weight, eps), add_rms_norm(x, residual, weight, eps)). The kernel's add_rms_norm
    updates `residual` in place: the caller owns the residual stream. `dim`: the norm's row length,
    for a model's norm (the kernel or the reference chosen here; per call only the layout is checked);
    None: the generic ops, which check each call's dtype and width too."""
    kernels = elementwise_kernels(device, dtype)
    if kernels is None or (dim is not None and not width_for_kernel(dim)):
        return rms_norm_reference, add_rms_norm_reference
    kernel = kernels.rms_norm
    takes = _rows_for_kernel if dim is None else _kernel_layout

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if takes(x):
            return kernel(x, None, weight, eps)
        return rms_norm_reference(x, weight, eps)

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if takes(x) and residual.is_contiguous():
            return kernel(x, residual, weight, eps), residual
        return add_rms_norm_reference(x, residual, weight, eps)

    return rms_norm, add_rms_norm


def select_gemma_norm(device: torch.device, dtype: torch.dtype, dim: int) -> RmsNorm:
    """gemma_norm(x, weight, eps) over rows of `dim` values, `weight` float32 (1 + w): the norm kernel
    (it takes a float32 weight and rounds the product once, Gemma's arithmetic) where it serves, else
    the reference. x may be [tokens, dim] or a strided [tokens, heads, dim] view (q/k heads), copied
    into rows for the kernel."""
    kernels = elementwise_kernels(device, dtype)
    if kernels is None or not width_for_kernel(dim):
        return gemma_rms_norm_reference
    kernel = kernels.rms_norm

    def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, dim)
        return kernel(rows if rows.is_contiguous() else rows.contiguous(), None, weight, eps).view(x.shape)

    return gemma_norm


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x = gate | up along the last dim → gelu_tanh(gate) * up (Gemma's MLP, as Hugging Face's)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def select_gelu_and_mul(device: torch.device, dtype: torch.dtype, width: int) -> Activation:
    """gelu_tanh_and_mul(x) for x of `width` (gate | up): the kernel where it serves, else the reference."""
    kernels = elementwise_kernels(device, dtype)
    if kernels is None or not width_for_kernel(width):
        return gelu_tanh_and_mul_reference
    kernel = kernels.gelu_tanh_and_mul

    def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return kernel(x) if _kernel_layout(x) else gelu_tanh_and_mul_reference(x)

    return gelu_and_mul


def select_activation(device: torch.device, dtype: torch.dtype, width: int | None = None) -> Activation:
    """silu_and_mul(x). `width`: x's row length (gate | up), for a model's MLP (chosen here; per call
    only the layout is checked); None: the generic op."""
    kernels = elementwise_kernels(device, dtype)
    if kernels is None or (width is not None and not width_for_kernel(width)):
        return silu_and_mul_reference
    kernel = kernels.silu_and_mul
    takes = _rows_for_kernel if width is None else _kernel_layout

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return kernel(x) if takes(x) else silu_and_mul_reference(x)

    return silu_and_mul


def select_rotary(device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                  rotary_dim: int | None = None) -> Rotary:
    """rotary(qkv, num_heads, cos, sin): the q and k heads rotated in place (the rotary half of the
    fused rotary + KV-write kernel, its caches unused). `head_dim`: the model's, for its attention
    backend: the kernel or the reference chosen here, with no check per call (a model's qkv is a
    contiguous view of its projection's output, its cos/sin tables in its dtype); None: the generic
    op, which checks each call (rotary_kernel_takes). `rotary_dim`: the dimensions rotated where fewer
    than head_dim (a partial rotary: the reference, which the kernels do not do)."""
    kernels = elementwise_kernels(device, dtype)
    if kernels is None or (head_dim is not None and not rotary_kernel_serves(dtype, head_dim, rotary_dim)):
        return rotary_reference
    kernel = kernels.rotary_write_kv

    if head_dim is not None:
        def bound_rotary(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
            kernel(qkv, cos, sin, qkv, qkv, None, num_heads)

        return bound_rotary

    def rotary(qkv: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if rotary_kernel_takes(qkv, cos):
            kernel(qkv, cos, sin, qkv, qkv, None, num_heads)
        else:
            rotary_reference(qkv, num_heads, cos, sin)

    return rotary


def rotary_kernel_serves(dtype: torch.dtype, head_dim: int, rotary_dim: int | None = None) -> bool:
    """Build time: whether the rotary kernels (alone, or fused with the KV write) serve a model of
    `dtype` with `head_dim` (all of it rotated: `rotary_dim` None or head_dim); the model's qkv and
    cos/sin then always meet rotary_kernel_takes."""
    return (dtype in (torch.float32, torch.bfloat16) and width_for_kernel(head_dim)
            and rotary_dim in (None, head_dim))


def rotary_kernel_takes(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the rotary kernels take this call's qkv and cos (the generic op's check of each call)."""
    return (rotary_kernel_serves(qkv.dtype, qkv.shape[-1]) and qkv.is_contiguous() and cos.dtype == qkv.dtype
            and cos.shape[-1] == qkv.shape[-1])


@dataclass(frozen=True)
class PlanMatmul:
    """A matmul kernel that a decode plan binds to weights and calls without checks, and the shapes it
    takes: weights of `dtype` with N % n_multiple == 0 and K % k_multiple == 0, at most max_rows rows
    (the same products `linear` gives it, so that plan and forward agree bit for bit)."""
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dtype: torch.dtype
    max_rows: int
    n_multiple: int
    k_multiple: int
    # The kernel as a plain C++ function (its module's `matmul_address`), for the layer loop in C++
    # (cpu_kernels' DecodeLayers); None: the plan's layers run in Python.
    address: int | None = None
    # One thread's share of the kernel for 1..15 rows (`matmul_slice_address`), with which the C++ loop
    # runs a layer in fewer parallel regions; None: it calls the whole kernel.
    slice_address: int | None = None
    # The same for weights that LinearOps.pack_weight packed.
    packed_slice_address: int | None = None


def _reference_linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return F.linear


def _reference_linear_to_float_for(weight: torch.Tensor) -> LinearToFloat:
    return linear_to_float_reference


@dataclass(frozen=True)
class LinearOps:
    linear: Linear
    linear_to_float: LinearToFloat    # x weight^T as float32 sums (the output head), never rounded to bf16
    plan_matmul: PlanMatmul | None    # what a decode plan binds; None: no decode plan for this model
    # A layer's weight [N, K] repacked once after loading into the layout `linear` reads fastest (None
    # for a weight that does not pack); the field is None where this op family reads [N, K] as loaded.
    pack_weight: PackWeight | None = None
    # The bound forms: `linear` (`linear_to_float`) for one final weight (packed or not) and bias, the
    # kernel or torch's chosen from them once; the result has the same signature and checks per call
    # only the number of rows (x: the model's activations, 2-D in its dtype).
    linear_for: LinearFor = _reference_linear_for
    linear_to_float_for: LinearToFloatFor = _reference_linear_to_float_for


def select_linear(device: torch.device, dtype: torch.dtype) -> LinearOps:
    """The linear layer: the AMX matmul (bf16, AMX), else the AVX512-BF16 one (bf16), each for
    decode-sized products; on a CPU without AVX512-BF16, cpu_kernels' linear_bf16 for every bf16
    product; linear_f32 (float32, where the build has it) for decode-sized products; torch's GEMM for
    the rest."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        if (gemv := amx_gemv()) is not None:
            return _amx_linear(gemv)
        if (gemv := cpu_gemv()) is not None:
            return _avx512_bf16_linear(gemv)
        if (kernels := cpu_kernels()) is not None:
            return _widening_bf16_linear(kernels)
    if device.type == "cpu" and dtype == torch.float32 and (f32 := f32_kernels()) is not None:
        return _f32_linear(f32)
    return LinearOps(F.linear, linear_to_float_reference, None)


def _bf16_kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a bf16 product is for the small-batch kernels (csrc/linear_bf16_avx512.cpp): 1..AMX_MAX_ROWS rows,
    K a multiple of 32, no bias."""
    return (bias is None and x.dim() == 2 and 1 <= x.shape[0] <= AMX_MAX_ROWS and x.dtype == torch.bfloat16
            and x.shape[1] % 32 == 0 and weight.dtype == torch.bfloat16 and weight.is_contiguous())


def _bf16_weight_takes(weight: torch.Tensor, bias: torch.Tensor | None, k_multiple: int = 32) -> bool:
    """Build time: the weight's half of what the bf16 kernels take (_bf16_kernel_takes; the widening
    kernel's `takes` with k_multiple = its lanes): an unpacked [N, K] bf16 weight, contiguous, K a
    multiple of `k_multiple`, no bias. For such a weight, a product of the model's activations goes to
    the kernel or not by its number of rows alone."""
    return (bias is None and weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.shape[1] % k_multiple == 0)


def _packed_linear(kernel: Linear) -> Linear:
    def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _on_packed(kernel, x, weight, bias)

    return packed_linear


def _rows_bounded_linear(kernel: Linear, max_rows: int) -> Linear:
    """kernel(x, weight) for products of 1..max_rows rows, torch's GEMM for the rest: the one check per
    call of a bound bf16 linear (no bias: the weight was checked when it was bound)."""
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return kernel(x, weight) if 0 < x.shape[0] <= max_rows else F.linear(x, weight, bias)

    return linear


def _rows_chunked_to_float(kernel: Callable[..., torch.Tensor], max_rows: int) -> LinearToFloat:
    """The head's float logits on `kernel` in pieces of at most max_rows rows; no rows: the reference."""
    def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= 1:
            return float_out_in_row_chunks(kernel, max_rows, x, weight)
        return linear_to_float_reference(x, weight)

    return linear_to_float


def _on_packed(kernel: Linear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """kernel(x, weight) for x of any leading dims, on a weight pack_bf16_weight packed (which has no
    PyTorch fallback: every call goes to the kernel), plus the bias in the model dtype."""
    y = kernel(x.reshape(-1, x.shape[-1]), weight)
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


def _amx_linear(gemv) -> LinearOps:
    amx, avx512 = gemv.linear_bf16_amx, gemv.linear_bf16_avx512

    def matmul(x: torch.Tensor, weight: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """What `linear` does with a bf16 product the kernels take (the plan binds `amx` itself, to the
        weights whose N is a multiple of 16)."""
        kernel = amx if weight.shape[0] % 16 == 0 else avx512   # N off the AMX tiles
        return kernel(x, weight, float_out=float_out)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return matmul(x, weight) if _bf16_kernel_takes(x, weight, bias) else F.linear(x, weight, bias)

    def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The output head: the kernel writes its float32 sums as they are.
        if x.shape[0] >= 1 and _bf16_kernel_takes(x[:1], weight, None):
            return float_out_in_row_chunks(matmul, AMX_MAX_ROWS, x, weight)
        return linear_to_float_reference(x, weight)

    def weight_kernel(weight: torch.Tensor) -> Callable[..., torch.Tensor]:
        return amx if weight.shape[0] % 16 == 0 else avx512   # N off the AMX tiles: AVX512-BF16

    def linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if not _bf16_weight_takes(weight, bias):
            return F.linear
        return _rows_bounded_linear(weight_kernel(weight), AMX_MAX_ROWS)

    def linear_to_float_for(weight: torch.Tensor) -> LinearToFloat:
        if not _bf16_weight_takes(weight, None):
            return linear_to_float_reference
        return _rows_chunked_to_float(weight_kernel(weight), AMX_MAX_ROWS)

    return LinearOps(linear, linear_to_float, PlanMatmul(amx, torch.bfloat16, AMX_MAX_ROWS, 16, 32,
                                                         gemv.matmul_address("linear_bf16_amx")),
                     linear_for=linear_for, linear_to_float_for=linear_to_float_for)


def _avx512_bf16_linear(gemv) -> LinearOps:
    """linear_bf16_avx512. A layer's weight (and the output head) is packed after loading into panels of
    16 columns ([N / 16, K, 16], pack_bf16_weight's layout), on which the kernel sums every output in one
    order at every row count (batch invariance), prefill chunks included; [N, K] weights (odd shapes)
    take its 1..128-row paths, which sum below 16 rows in another order, and torch's GEMM beyond."""
    # The kernel takes every product `_bf16_kernel_takes` admits (AVX512_MAX_ROWS == AMX_MAX_ROWS), so it
    # is the plan's matmul as it is.
    assert AVX512_MAX_ROWS == AMX_MAX_ROWS
    avx512 = gemv.linear_bf16_avx512

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() == 3:
            return _on_packed(avx512, x, weight, bias)
        return avx512(x, weight) if _bf16_kernel_takes(x, weight, bias) else F.linear(x, weight, bias)

    def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() == 3:
            return avx512(x.reshape(-1, x.shape[-1]), weight, float_out=True)
        if x.shape[0] >= 1 and _bf16_kernel_takes(x[:1], weight, None):
            return float_out_in_row_chunks(avx512, AVX512_MAX_ROWS, x, weight)
        return linear_to_float_reference(x, weight)

    def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
        return pack_bf16_weight(weight, 16, 32)

    def linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if weight.dim() == 3:
            return _packed_linear(avx512)
        if not _bf16_weight_takes(weight, bias):
            return F.linear
        return _rows_bounded_linear(avx512, AVX512_MAX_ROWS)

    def linear_to_float_for(weight: torch.Tensor) -> LinearToFloat:
        if weight.dim() == 3:
            return lambda x, weight: avx512(x.reshape(-1, x.shape[-1]), weight, float_out=True)
        if not _bf16_weight_takes(weight, None):
            return linear_to_float_reference
        return _rows_chunked_to_float(avx512, AVX512_MAX_ROWS)

    return LinearOps(linear, linear_to_float, PlanMatmul(avx512, torch.bfloat16, AVX512_MAX_ROWS, 1, 32,
                                                         gemv.matmul_address("linear_bf16_avx512"),
                                                         gemv.matmul_slice_address("linear_bf16_avx512"),
                                                         gemv.matmul_slice_address("linear_bf16_avx512_packed")),
                     pack_weight, linear_for, linear_to_float_for)


def _widening_bf16_linear(kernels) -> LinearOps:
    """bf16 products on cpu_kernels' linear_bf16 (the weights widened to float32 in the kernel), at
    every row count: torch's bf16 GEMM emulates bf16 there, at a fraction of the kernel's rate. A
    layer's weight (and the output head) is packed after loading into panels of 16 columns
    ([N / 16, K, 16], each k a row of 16 values: one stream per panel, no transpose per call); [N, K]
    weights (odd shapes) still take the kernel."""
    kernel, lanes, panel = kernels.linear_bf16, kernels.lanes, kernels.panel_columns

    def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return (bias is None and x.dim() == 2 and x.shape[0] >= 1 and x.dtype == torch.bfloat16
                and x.shape[1] % lanes == 0 and weight.dtype == torch.bfloat16 and weight.is_contiguous())

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() == 3:
            return _on_packed(kernel, x, weight, bias)
        return kernel(x, weight) if takes(x, weight, bias) else F.linear(x, weight, bias)

    def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() == 3 or takes(x, weight, None):   # a packed weight has no PyTorch fallback
            return kernel(x.reshape(-1, x.shape[-1]), weight, float_out=True)
        return linear_to_float_reference(x, weight)

    def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
        return pack_bf16_weight(weight, panel, lanes)

    def to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernel(x.reshape(-1, x.shape[-1]), weight, float_out=True)

    def linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if weight.dim() == 3:
            return _packed_linear(kernel)
        if not _bf16_weight_takes(weight, bias, lanes):
            return F.linear

        def bound_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return kernel(x, weight) if x.shape[0] > 0 else F.linear(x, weight, bias)   # every row count

        return bound_linear

    def linear_to_float_for(weight: torch.Tensor) -> LinearToFloat:
        if weight.dim() == 3:   # a packed weight has no PyTorch fallback
            return to_float
        if not _bf16_weight_takes(weight, None, lanes):
            return linear_to_float_reference

        def bound_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return to_float(x, weight) if x.shape[0] > 0 else linear_to_float_reference(x, weight)

        return bound_to_float

    return LinearOps(linear, linear_to_float, PlanMatmul(kernel, torch.bfloat16, WIDENING_BF16_PLAN_ROWS, 1, lanes,
                                                         kernels.matmul_address("linear_bf16"),
                                                         kernels.matmul_slice_address("linear_bf16"),
                                                         kernels.matmul_slice_address("linear_bf16_packed")),
                     pack_weight, linear_for, linear_to_float_for)


def pack_bf16_weight(weight: torch.Tensor, panel: int, lanes: int) -> torch.Tensor | None:
    """weight [N, K] bf16 as linear_bf16's packed panels [N / panel, K, panel], each k-row's two halves
    interleaved: packed[p, k, 2j + h] = weight[p * panel + h * panel / 2 + j, k], so that a 32-bit word
    holds two columns half a panel apart and widens by a shift and a mask (csrc/float_tiles.h,
    load_panel_row). None where N is not a multiple of `panel` or K of `lanes`."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n % panel or k % lanes or n == 0:
        return None
    halves = weight.detach().view(n // panel, 2, panel // 2, k)
    return halves.permute(0, 3, 2, 1).reshape(n // panel, k, panel).contiguous()


def packed_bf16_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The rows `rows` of the [N, K] weight that pack_bf16_weight packed ([N / panel, K, panel])."""
    panel = packed.shape[2]
    column = rows % panel
    slot = 2 * (column % (panel // 2)) + column // (panel // 2)
    return packed[rows // panel, :, slot]


def gguf_plan_matmul() -> PlanMatmul | None:
    """cpu_kernels()' linear_gguf (y = x w^T for bf16 x and GGUF Q8_0 / Q6_K / Q4_K / Q4_1 / Q5 blocks packed by
    gguf_blocks.pack_gguf_weight, any row count), as GGUFLinear calls it and a decode plan binds it
    (with its address, for the C++ layer loop); None where the kernels do not build (GGUF weights are
    then dequantized at load, as every other GGUF type)."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    return PlanMatmul(kernels.linear_gguf, torch.uint8, WIDENING_BF16_PLAN_ROWS, GGUF_PANEL, 16,
                      kernels.matmul_address("linear_gguf"))


def _f32_linear(f32: F32Kernels) -> LinearOps:
    kernel = f32.linear_f32

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.dim() == 2 and weight.dtype == torch.float32
                and 1 <= x.shape[0] <= F32_MAX_ROWS and x.shape[1] % 8 == 0 and weight.is_contiguous()):
            y = kernel(x, weight)
            return y if bias is None else y.add_(bias)
        return F.linear(x, weight, bias)

    def linear_to_float(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight).float()

    def bound_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if 0 < x.shape[0] <= F32_MAX_ROWS:
            y = kernel(x, weight)
            return y if bias is None else y.add_(bias)
        return F.linear(x, weight, bias)

    def linear_for(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """The weight's half of `linear`'s check (a bias is added after the kernel, so any bias)."""
        takes = (weight.dim() == 2 and weight.dtype == torch.float32 and weight.is_contiguous()
                 and weight.shape[1] % 8 == 0)
        return bound_linear if takes else F.linear

    def linear_to_float_for(weight: torch.Tensor) -> LinearToFloat:
        bound = linear_for(weight, None)
        return lambda x, weight: bound(x, weight).float()

    return LinearOps(linear, linear_to_float, PlanMatmul(kernel, torch.float32, F32_MAX_ROWS, 1, 8, f32.address),
                     linear_for=linear_for, linear_to_float_for=linear_to_float_for)


def select_argmax(device: torch.device) -> Argmax:
    """x.argmax(dim=-1) for float32 [B, V]: the CPU kernel where it builds (torch's argmax takes ~3 ms
    over 48 rows of a 49k vocabulary, a few percent of a decode step), else torch."""
    kernels = cpu_kernels() if device.type == "cpu" else None
    if kernels is None:
        return argmax_reference
    kernel = kernels.argmax_rows

    def argmax_rows(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0:
            return kernel(x)
        return x.argmax(dim=-1)

    return argmax_rows


@dataclass(frozen=True)
class PlanKernels:
    """The raw kernels a decode plan calls without checks (kestrel/model/decode_plan.py)."""
    rms_norm: Callable     # rms_norm(x, residual or None, weight, eps); residual += x in place
    silu_and_mul: Callable
    matmul: PlanMatmul
    layer_loop: type   # cpu_kernels' DecodeLayers: the layer loop in C++, over a matmul with an address


@dataclass(frozen=True)
class Ops:
    """The implementation of each op family for one (device, dtype): the generic forms, which check
    each call, and the bound ones (`*_for`), which a model's layers take when they are built (the norms,
    the activation, rotary) or once their weights are final (the linear layers and the output head,
    kestrel/model/layers.py: bind_linear_ops_)."""
    rms_norm: RmsNorm
    add_rms_norm: AddRmsNorm
    silu_and_mul: Activation
    rotary: Rotary
    linear: Linear
    linear_to_float: LinearToFloat
    plan_kernels: PlanKernels | None   # None: decode steps of this model run its forward
    pack_weight: PackWeight | None     # LinearOps.pack_weight
    norm_for: Callable[[int], tuple[RmsNorm, AddRmsNorm]]   # row length -> select_norm(..., dim)
    gemma_norm_for: Callable[[int], RmsNorm]               # row length -> select_gemma_norm(..., dim)
    gelu_and_mul_for: Callable[[int], Activation]          # gate | up width -> select_gelu_and_mul(...)
    silu_and_mul_for: Callable[[int], Activation]          # gate | up width -> select_activation(..., width)
    rotary_for: Callable[..., Rotary]                      # head_dim[, rotary_dim] -> select_rotary(...)
    linear_for: LinearFor                                  # LinearOps.linear_for
    linear_to_float_for: LinearToFloatFor                  # LinearOps.linear_to_float_for


def select_ops(device: torch.device, dtype: torch.dtype) -> Ops:
    rms_norm, add_rms_norm = select_norm(device, dtype)
    linear = select_linear(device, dtype)
    elementwise = elementwise_kernels(device, dtype)
    plan = None
    if elementwise is not None and linear.plan_matmul is not None:
        plan = PlanKernels(elementwise.rms_norm, elementwise.silu_and_mul, linear.plan_matmul, elementwise.DecodeLayers)
    return Ops(rms_norm, add_rms_norm, select_activation(device, dtype), select_rotary(device, dtype),
               linear.linear, linear.linear_to_float, plan, linear.pack_weight,
               norm_for=lambda dim: select_norm(device, dtype, dim),
               gemma_norm_for=lambda dim: select_gemma_norm(device, dtype, dim),
               gelu_and_mul_for=lambda width: select_gelu_and_mul(device, dtype, width),
               silu_and_mul_for=lambda width: select_activation(device, dtype, width),
               rotary_for=lambda head_dim, rotary_dim=None: select_rotary(device, dtype, head_dim, rotary_dim),
               linear_for=linear.linear_for, linear_to_float_for=linear.linear_to_float_for)
