"""Quantized decoder projections: --quantization int8, and a GGUF file's Q8_0, Q6_K, Q4_K, Q4_1, Q4_0,
Q5_K, Q5_1 and Q5_0 weights as the file stores them (or nearly).

GGUF blocks (as vLLM runs a GGUF file's quantized weights, and llama.cpp does): a projection (and the
embedding and output head) whose tensors the file stores in one of those types keeps them (1.06, 0.82,
0.56, 0.63, 0.56, 0.69, 0.75 and 0.69 bytes a weight in the file; 1.125, 0.83, 0.59, 0.75, 0.75, 0.72,
0.875 and 1.125 as the kernel packs them, against 2 for bf16), where the model is bf16 on a CPU with the
kernels (csrc/linear_gguf.cpp's linear_gguf, on llama.cpp's float32 values of the weights). The default
model's layers are Q4_1. Below 16 rows (decode steps of a few requests) Q4_K, Q4_1 (and Q4_0) and
Q5_1 sum each block of 32 in integers against the activations held as 16-bit integers (exact for bf16
activations within 2^7 of their block's largest), Q6_K each block of 16 and Q5_K (at 1 and 2 rows)
each block of 32 against 14-bit ones split in two bytes (within 2^6); Q8_0 from 8 rows and Q5_K from
3 take the 16-bit ones too. From 16 rows (prefill chunks,
decode steps of 16 requests or more), Q4_K and Q6_K run, as llama.cpp runs them, against the
activations quantized to 8 bits (per block of 32, where llama.cpp's Q8_K has one scale per 256); with
AVX512-BF16, Q8_0, Q4_1 and the Q5s on bf16 panels. Elsewhere, under --quantization int8 or none, and
for every other GGUF type (Q2_K, Q3_K, the IQ types, ...), the weights are dequantized at load.
`keep_gguf_blocks_` decides, once, before the weights are read.

--quantization int8: the decoder layers' projections in int8, quantized at load time from the
checkpoint's weights (no calibration, no quantized checkpoint needed).

Weights: symmetric int8 with one float32 scale per output row (max |w| / 127). Activations: each token's
row is quantized the same way at every product (dynamic, per token), so the matrix products run as
int8 × int8 summed exactly in int32; y = (acc × weight scale) × token scale, rounded once to the model
dtype. This is the W8A8 scheme of vLLM's CPU int8 path: weight-only int8 was measured slower here,
because widening int8 to bf16 costs more than the bytes it saves.

Where K is a multiple of 64 (always, where the kernel runs), both sides are first rotated by the
orthonormal Hadamard transform on each block of 64 values along K: x W^T = (x H)(W H)^T. The rotation
spreads an outlier activation over its block, so that one large channel no longer sets the scale that
every other value of the token is rounded to (the idea of QuaRot; here with fixed blocks, no
calibration). Measured on the default model: top-1 agreement with the float32 engine 97.7% of
positions with it, 91.3% without (BENCHMARKS.md).

The embedding, the output head and the norms stay in the model dtype (as vLLM leaves lm_head
unquantized by default). The products run, with bit-identical results, in csrc/linear_bf16_avx512.cpp's
linear_int8_amx on CPUs with AMX-INT8; else in csrc/linear_int8.cpp's linear_int8 (AVX512-VNNI, or AVX2);
else in `linear_int8_reference` (PyTorch). Which one a model's layers use is decided once, when the
model is quantized (`select_int8_matmul`), and for each projection from its weight's shape
(`int8_matmul_for`: AMX takes K % 64 == 0 and N % 16 == 0), so that a call checks only its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kestrel.model.layers import Linear
from kestrel.ops.dispatch import PlanMatmul, amx_gemv, gguf_plan_matmul, int8_kernels
from kestrel.ops.gguf_blocks import GGUF_FORMATS, GGUFFormat, gguf_packable, gguf_rows, pack_gguf_weight
from kestrel.ops.huge_pages import return_freed_memory

# (x [M, K], qweight [N, K], scale [N]) -> y [M, N] in x's dtype
Int8Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# "none": no quantized weights at all, a GGUF file's blocks dequantized to the model dtype at load (as
# transformers runs a GGUF file); unset (None): the checkpoint's own (a GGUF file's kept blocks).
QUANTIZATION_METHODS = ("int8", "none")

# Up to this K, |sum of K products of two int8 in [-127, 127]| < 2^24, so float32 sums them exactly.
_FLOAT32_EXACT_K = (1 << 24) // (127 * 127)


def check_quantization(method: str | None) -> str | None:
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ValueError(f"quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATION_METHODS)} "
                     f"or leave it unset")


def hadamard64(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 64 == 0) in float32 with each block of 64 values along K transformed by the
    Walsh-Hadamard matrix / 8 (orthonormal, its own inverse). The butterflies run with strides 1, 2, 4,
    ..., 32 in that order, as the kernel's do, so both give the same float32 bits."""
    shape = x.shape
    v = x.float().reshape(-1, 64)
    h = 1
    while h < 64:
        v = v.view(v.shape[0], 64 // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2).view(-1, 64)
        h *= 2
    return (v * 0.125).view(shape)


def rotates(k: int) -> bool:
    """Whether products over this K run rotated (kernel and reference alike)."""
    return k % 64 == 0


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scale per row) of a weight [N, K], rotated first where K allows."""
    return symmetric_int8(hadamard64(w) if rotates(w.shape[1]) else w)


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
    """What linear_int8_amx computes, in PyTorch: x [M, K] rotated (where K allows) and quantized per
    row, exact integer sums, (acc × scale[n]) × x_scale[m] in float32, rounded once to x's dtype."""
    xq, x_scale = symmetric_int8(hadamard64(x) if rotates(x.shape[1]) else x)
    exact = torch.float32 if qweight.shape[1] <= _FLOAT32_EXACT_K else torch.float64
    acc = (xq.to(exact) @ qweight.to(exact).T).float()
    return ((acc * scale) * x_scale[:, None]).to(x.dtype)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                matmul: Int8Matmul = linear_int8_reference) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias), for (qweight, scale) = quantize_weight(W), with x quantized per token,
    through `matmul` (a `select_int8_matmul` choice; the reference by default)."""
    if x.dim() != 2:
        y = linear_int8(x.reshape(-1, x.shape[-1]), qweight, scale, bias, matmul)
        return y.view(*x.shape[:-1], qweight.shape[0])
    y = matmul(x, qweight, scale)
    return y if bias is None else y + bias


def select_int8_matmul(device: torch.device, dtype: torch.dtype) -> Int8Matmul:
    """The int8 matmul of a model on `device` in `dtype`: for bf16 on a CPU, cpu_gemv's AMX-INT8 kernel
    where AMX runs (for the products it takes: K % 64 == 0, N % 16 == 0), cpu_kernels' linear_int8
    (AVX512-VNNI or AVX2) where the build has it, for every product AMX does not take or everywhere
    without AMX; elsewhere the reference. The result checks each call; `int8_matmul_for` binds it to
    one weight's shape."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return linear_int8_reference
    amx = amx_gemv()
    kernels = int8_kernels()
    if amx is None and kernels is None:
        return linear_int8_reference
    return Int8Kernels(amx.linear_int8_amx if amx is not None else None,
                       kernels.linear_int8 if kernels is not None else None)


def _amx_takes_weight(n: int, k: int) -> bool:
    """Build time: whether linear_int8_amx takes a weight [N, K] (its tiles: K % 64, N % 16)."""
    return k % 64 == 0 and n % 16 == 0


@dataclass(frozen=True)
class Int8Kernels:
    """The int8 matmul of a bf16 CPU model (select_int8_matmul): AMX-INT8 for the products it takes,
    cpu_kernels' linear_int8 (any shape, bf16 x only) for the rest, the reference where neither is."""
    amx: Int8Matmul | None
    vnni: Int8Matmul | None

    def __call__(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The generic op: each call checked (x's dtype and shape, the weight's)."""
        if (self.amx is not None and x.dtype == torch.bfloat16 and x.shape[0] >= 1
                and _amx_takes_weight(qweight.shape[0], x.shape[1])):
            return self.amx(x, qweight, scale)
        if self.vnni is not None and x.dtype == torch.bfloat16:
            return self.vnni(x, qweight, scale)
        return linear_int8_reference(x, qweight, scale)

    def for_weight(self, n: int, k: int) -> Int8Matmul:
        """The op for a projection with weight [N, K] that takes the model's (bf16) activations: AMX
        or not decided here; per call only the number of rows (AMX takes at least one)."""
        rest = self.vnni if self.vnni is not None else linear_int8_reference
        if self.amx is None or not _amx_takes_weight(n, k):
            return rest
        amx = self.amx

        def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return amx(x, qweight, scale) if x.shape[0] >= 1 else rest(x, qweight, scale)

        return int8_matmul


def int8_matmul_for(matmul: Int8Matmul, weight: torch.Tensor) -> Int8Matmul:
    """`matmul` (a select_int8_matmul choice) bound to the shape of one projection's weight [N, K]."""
    return matmul.for_weight(*weight.shape) if isinstance(matmul, Int8Kernels) else matmul


class Int8Linear(nn.Module):
    """A Linear with its weight held as int8 rows and a float32 scale per row."""

    def __init__(self, linear: Linear, matmul: Int8Matmul = linear_int8_reference) -> None:
        super().__init__()
        self.matmul = matmul
        qweight, scale = quantize_weight(linear.weight.data)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data, requires_grad=False)
        self.has_bias = linear.bias is not None
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_int8(x, self.qweight, self.scale, self.bias if self.has_bias else None, self.matmul)

    __call__ = forward  # as Linear's: no hook machinery on the decode path


def quantize_model_(model: nn.Module, method: str | None) -> int:
    """Replace every decoder projection (`Linear`) of a loaded model by its quantized form, in place;
    the number replaced. The full-precision weights are dropped."""
    if check_quantization(method) in (None, "none"):
        return 0
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    if not targets:
        return 0
    weight = targets[0][1].weight
    matmul = select_int8_matmul(weight.device, weight.dtype)   # once for the model
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(module, int8_matmul_for(matmul, module.weight)))   # its shape
    return len(targets)


# ---- GGUF blocks ------------------------------------------------------------------------------------

class GGUFLinear(nn.Module):
    """A projection (or the embedding, or the output head, or both where tied) holding a GGUF file's blocks
    (Q8_0, Q6_K, Q4_K, Q4_1, Q4_0, the Q5s: kestrel/ops/gguf_blocks.py), `parts` saying which: (format,
    rows) down its N rows, in order (a fused projection may hold parts of several types). Until `pack_`,
    `weight` is uint8 [N, the widest part's row bytes], each part's file rows from column 0, which
    load_weights fills; then linear_gguf's packed weight. `plan_matmul`: its kernel (linear_gguf), which
    a decode plan binds."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, plan_matmul: PlanMatmul,
                 parts: list[tuple[GGUFFormat, int]], dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype   # the model's: what `rows` gives
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts
        width = max(fmt.row_bytes(in_features) for fmt, _ in parts)
        self.weight = nn.Parameter(torch.empty(out_features, width, dtype=torch.uint8), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.has_bias = bias is not None
        self.plan_matmul = plan_matmul
        self.matmul = plan_matmul.kernel

    @classmethod
    def replacing(cls, module: nn.Module, plan_matmul: PlanMatmul, parts: list[tuple[GGUFFormat, int]]) -> GGUFLinear:
        """The GGUF form of a Linear, or of an embedding or output head (an Embedding [vocab, hidden])."""
        if isinstance(module, Linear):
            bias = None if module.bias is None else module.bias.data
            return cls(module.in_features, module.out_features, bias, plan_matmul, parts, module.weight.dtype)
        return cls(module.embedding_dim, module.num_embeddings, None, plan_matmul, parts, module.weight.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """As the output head: float32 logits [rows, vocab], not rounded to bf16 (Embedding.logits)."""
        return self.matmul(x, self.weight, float_out=True)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """As the embedding: its rows for `ids`, dequantized, in the model's dtype (Embedding.rows)."""
        return gguf_rows(self.weight, ids).to(self.dtype)

    def pack_(self) -> None:
        parts, row = [], 0
        for fmt, rows in self.parts:
            parts.append((fmt, self.weight.data[row:row + rows, :fmt.row_bytes(self.in_features)]))
            row += rows
        self.weight.data = pack_gguf_weight(parts, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    __call__ = forward  # as Linear's: no hook machinery on the decode path


def keep_gguf_blocks_(model: nn.Module, reader: object, quantization: str | None) -> int:
    """Before the weights are read: every projection (`Linear`), the embedding and the output head (one
    module where they are tied) whose checkpoint tensors `reader` (a GGUF reader: `block_types`) holds
    in types linear_gguf runs (GGUF_FORMATS), replaced by a GGUFLinear that load_weights fills with the
    file's blocks, where linear_gguf runs (a bf16 model on a CPU with the kernels), no --quantization
    is asked for and the shapes pack (whole panels of 16 rows per type, a tensor-parallel share of K on
    whole blocks). The number replaced; 0 leaves every weight to be dequantized as before."""
    block_types = getattr(reader, "block_types", None)
    targets = {name: module for name, module in model.named_modules() if type(module) is Linear}
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    for name, module in (("embed_tokens", embed), ("lm_head", head)):
        if module is not None and module not in targets.values():
            targets[name] = module   # a tied head is the embedding: one module, read once
    if block_types is None or quantization is not None or not targets:
        return 0
    weight = next(iter(targets.values())).weight
    plan_matmul = gguf_plan_matmul() if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 else None
    if plan_matmul is None:
        return 0
    types = block_types()
    sources: dict[str, list[tuple[int, int, GGUFFormat | None]]] = {}   # module -> (row, rows, format) per tensor
    for name, placement in ((tensor, p) for tensor in reader.names() for p in model.placements(tensor)):
        if not placement.param.endswith(".weight"):
            continue
        module = placement.param.removesuffix(".weight")
        if module in targets:
            fmt = GGUF_FORMATS.get(types.get(name, ""))
            if fmt is not None and placement.dim not in (None, 0) and (
                    placement.start % fmt.file_block or (placement.size or 0) % fmt.file_block):
                fmt = None   # a column share that splits the type's blocks
            rows = targets[module].weight.shape[0] if placement.rows is None else placement.rows
            sources.setdefault(module, []).append((placement.row, rows, fmt))
    replaced = 0
    for name, placed in sources.items():
        module = targets[name]
        n, k = module.weight.shape   # [N, K]: a Linear's and a head's alike
        placed.sort(key=lambda source: source[0])
        parts = [(fmt, rows) for _, rows, fmt in placed if fmt is not None and gguf_packable(fmt, rows, k)]
        if len(parts) == len(placed) and sum(rows for _, rows in parts) == n:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, GGUFLinear.replacing(module, plan_matmul, parts))
            replaced += 1
    if head is not None and head is embed:
        model.lm_head = model.embed_tokens   # still tied, in whichever form the embedding now has
    return replaced


def pack_gguf_weights_(model: nn.Module) -> int:
    """After loading: each GGUFLinear's blocks put in the kernel's layout; the number packed."""
    layers = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    for layer in layers:
        layer.pack_()
        return_freed_memory()  # the file's layout of these blocks: the RSS peaks at one layer's two copies
    return len(layers)
