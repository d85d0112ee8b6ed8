"""Building blocks shared by the decoder models: RMSNorm (with the residual add fused), the linear
layer, SiLU-and-mul and rotary position embeddings.

Each module runs the implementation of its op family that the model's device and dtype select, once,
when the model is built (kestrel/ops/dispatch.py: the compiled CPU kernels where they serve, else the
PyTorch references, which follow Hugging Face's arithmetic so that float32 runs match `transformers`).
What a layer's shape decides is decided then too: the norms and the activation take the bound op for
their row length when they are built, the linear layers and the output head the one for their weight
once it is final (bind_linear_ops_, after loading, quantization and packing).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.ops.dispatch import (  # noqa: F401
    AMX_MAX_ROWS,
    F32_MAX_ROWS,
    LinearToFloat,
    RmsNorm,
    apply_rotary,
    linear_to_float_reference,
    packed_bf16_rows,
    rms_norm_reference,
    silu_and_mul_reference,
)
from kestrel.ops.dispatch import Linear as LinearFn
from kestrel.ops.huge_pages import return_freed_memory


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, norm: RmsNorm = rms_norm_reference) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


class Embedding(nn.Embedding):
    """The token embedding and the output head: nn.Embedding's parameter, left as allocated (like
    Linear's, it is filled by load_weights). As the head, `logits` runs the model's linear_to_float op."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype,
                 linear_to_float: LinearToFloat = linear_to_float_reference) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype=dtype)
        self.linear_to_float = linear_to_float

    def reset_parameters(self) -> None:
        pass

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] -> float32 [rows, vocab]: x W^T summed in float32 and not rounded to the model's
        dtype (bf16 logits tie where the reference's differ)."""
        return self.linear_to_float(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for `ids`."""
        return embedding_rows(self.weight, ids)


class Linear(nn.Linear):
    """A projection of a decoder layer: nn.Linear's parameters, forward through the selected linear op
    (the small-batch kernels for decode-sized products where they serve). --quantization replaces it
    (kestrel/model/quantization.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 linear: LinearFn = F.linear):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.has_bias = bias  # a plain attribute: reading `self.bias` goes through nn.Module.__getattr__
        self.linear = linear

    def reset_parameters(self) -> None:
        """No random values: load_weights fills every parameter from the checkpoint (nn.Linear's
        initialisation took 1 s of the default model's start and would take 8 s of a 1B model's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias if self.has_bias else None)

    # Called straight, without nn.Module's hook machinery. Each µs here is 120 µs of a decode step of
    # the default model (measured: the module call and the bias lookup cost ~3.5 µs a call, ~2% of a
    # batch-1 step). Kestrel registers no hooks on these modules.
    __call__ = forward


def pack_linear_weights_(model: nn.Module) -> int:
    """Each Linear's weight, and the output head's, repacked in place into the layout the linear op
    reads fastest (the model's `ops.pack_weight`; vLLM's process_weights_after_loading), once, after
    loading and quantization; then each bound to its op (bind_linear_ops_), the weights now final.
    The Parameter objects stay; only their data changes. Returns the number of weights packed (0 where
    the op family keeps [N, K])."""
    ops = getattr(model, "ops", None)
    pack = getattr(ops, "pack_weight", None)
    packed = 0
    if pack is not None:
        weights = [module.weight for module in model.modules() if type(module) is Linear]
        # The output head too, tied to the embedding or not: the model looks tokens up with
        # embedding_rows, which reads either layout.
        head = getattr(model, "lm_head", None)
        if head is not None:
            weights.append(head.weight)
        for weight in weights:
            if (layout := pack(weight)) is not None:
                weight.data = layout
                packed += 1
                return_freed_memory()  # the weight's old layout
    if ops is not None:
        bind_linear_ops_(model, ops)
    return packed


def bind_linear_ops_(model: nn.Module, ops) -> int:
    """Each Linear's op, and the output head's, chosen once for its final weight (`ops.linear_for`,
    `ops.linear_to_float_for`: the kernel or torch's, packed or not, from the weight's shape, dtype,
    layout and bias), so that a call checks only its number of rows. After loading, quantization and
    packing: a weight changed after this (other than moved, as move_to_huge_pages does) needs it again.
    Returns the number of ops bound."""
    bound = 0
    for module in model.modules():
        if type(module) is Linear:
            module.linear = ops.linear_for(module.weight, module.bias if module.has_bias else None)
            bound += 1
    head = getattr(model, "lm_head", None)
    if type(head) is Embedding:
        head.linear_to_float = ops.linear_to_float_for(head.weight)
        bound += 1
    return bound


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows of an embedding table [V, K] for `ids`, or of the same table packed as the output head it
    is tied to ([V / 16, K, 16], pack_linear_weights_)."""
    if table.dim() == 3:
        return packed_bf16_rows(table, ids)
    return F.embedding(ids, table)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the rope types we support."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "longrope":   # the short factors' frequencies (longrope_tables has both)
        return longrope_tables(head_dim, theta, scaling)[0], _longrope_attention_factor(scaling)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3, longrope)")


def longrope_tables(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE's (Phi-3's) inverse frequencies with its short and its long factors, as Hugging Face
    computes them."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return tuple(1.0 / (torch.tensor(s[key], dtype=torch.float32) * theta ** shape)
                 for key in ("short_factor", "long_factor"))


def _longrope_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for every position up to `max_positions`, looked up per token.

    LongRoPE: positions before the original context length take the short factors' rows, later ones
    the long factors'. Hugging Face uses one set for a whole sequence: the short one up to the original
    length, the long one past it, recomputing the cached keys when a generation crosses it; vLLM picks
    one set per batch. Both agree with these tables on sequences within the original length; past it
    the keys before it differ (Kestrel computes no key twice)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        if (scaling or {}).get("rope_type") == "longrope":
            original = scaling["original_max_position_embeddings"]
            freqs[original:] = torch.outer(positions[original:], longrope_tables(head_dim, theta, scaling)[1])
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for a step's tokens, [tokens, 1, head_dim]; looked up once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
