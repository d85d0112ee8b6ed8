"""GGUF model files: header parsing, config, weights (HF names) and tokenizer.

The header is parsed here rather than with ``gguf.GGUFReader``: the reader
builds a numpy memmap view for every token string and merge in the
vocabulary, which costs ~4.5 s on SmolLM2 (98k strings) while this parser
takes well under a second. Tensor data of the common types (F16, BF16, Q4_0, Q4_1, Q8_0) is decoded
here with torch, bit for bit as ``gguf.quants.dequantize`` decodes it but ~5x faster (its numpy
passes took ~2 s of every start of the default model); other types go through ``gguf.quants``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import dequantize

from kestrel import envs

# transformers is imported where it is used (why: kestrel/model/loader.py).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "granite")
SUPPORTED_GGUF_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest dim first), i.e. reversed GGUF dims
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    file_size: int
    # Each metadata key's GGUF type, and for an array its items' type (None for a scalar): what a
    # writer needs to copy the metadata exactly (kestrel/bench/peers.py).
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))


class _HeaderOverrun(Exception):
    """The header claims more bytes than the file holds."""


class _Cursor:
    """Bounds-checked little-endian reads from a byte buffer."""

    def __init__(self, buf: mmap.mmap | bytes, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _HeaderOverrun
        self.pos = start + n
        return start

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buf, self.take(fmt.size))[0]

    def string(self) -> str:
        n = self.unpack(_U64)
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8")


_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


def _float32_to_python(x: float) -> float:
    # Metadata floats are float32; round-trip through the shortest float32 str so
    # e.g. rms_norm_eps reads 1e-05 rather than 9.999999747378752e-06.
    return float(str(np.float32(x)))


def _read_value(cur: _Cursor, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        return _read_array(cur)
    value = cur.unpack(_SCALAR_FORMATS[vtype])
    return _float32_to_python(value) if vtype == GGUFValueType.FLOAT32 else value


def _read_array(cur: _Cursor) -> list[Any]:
    item_type = GGUFValueType(cur.unpack(_U32))
    count = cur.unpack(_U64)
    if item_type in _NUMPY_DTYPES:
        dtype = np.dtype(_NUMPY_DTYPES[item_type])
        start = cur.take(count * dtype.itemsize)
        return np.frombuffer(cur.buf, dtype=dtype, count=count, offset=start).tolist()
    return [_read_value(cur, item_type) for _ in range(count)]


def _tensor_n_bytes(name: str, gguf_dims: list[int], qtype: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(gguf_dims, dtype=np.int64)) if gguf_dims else 1
    if gguf_dims and gguf_dims[0] % block_size:
        raise ValueError(f"tensor {name}: row length {gguf_dims[0]} not a multiple of {qtype.name} block size")
    return n_elements // block_size * type_size


def _parse_header(path: str, buf: mmap.mmap, file_size: int) -> GGUFHeader:
    cur = _Cursor(buf, file_size)
    magic = cur.unpack(_U32)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is corrupt or not a GGUF file: bad magic {bytes(buf[:4])!r} (expected b'GGUF')"
        )
    version = cur.unpack(_U32)
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ValueError(
            f"{path} is corrupt or an unsupported GGUF version {version} "
            f"(supported: {SUPPORTED_GGUF_VERSIONS}; big-endian files are not supported)"
        )
    tensor_count = cur.unpack(_U64)
    kv_count = cur.unpack(_U64)

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for _ in range(kv_count):
        key = cur.string()
        vtype = GGUFValueType(cur.unpack(_U32))
        item_type = None
        if vtype == GGUFValueType.ARRAY:  # it starts with its items' type: peeked here, read by _read_array
            at = cur.pos
            item_type = GGUFValueType(cur.unpack(_U32))
            cur.pos = at
        value_types[key] = (vtype, item_type)
        metadata[key] = _read_value(cur, vtype)

    raw_tensors = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.unpack(_U32)
        if n_dims > GGML_MAX_DIMS:
            raise ValueError(f"{path} is corrupt: tensor {name!r} has {n_dims} dims")
        dims = [cur.unpack(_U64) for _ in range(n_dims)]
        qtype = GGMLQuantizationType(cur.unpack(_U32))
        rel_offset = cur.unpack(_U64)
        raw_tensors.append((name, dims, qtype, rel_offset))

    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, qtype, rel_offset in raw_tensors:
        n_bytes = _tensor_n_bytes(name, dims, qtype)
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, data_start + rel_offset, n_bytes)
    return GGUFHeader(path, version, metadata, tensors, file_size, value_types)


def _check_tensor_data_fits(header: GGUFHeader) -> None:
    needed = max((t.offset + t.n_bytes for t in header.tensors.values()), default=0)
    if needed > header.file_size:
        raise ValueError(
            f"{header.path} is truncated: its tensor data needs {needed} bytes "
            f"but the file has only {header.file_size} (incomplete download or copy?)"
        )


@functools.lru_cache(maxsize=8)
def _read_header_cached(path: str, file_size: int, mtime_ns: int) -> GGUFHeader:
    if file_size < 24:
        raise ValueError(f"{path} is corrupt or truncated: only {file_size} bytes, too small for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            header = _parse_header(path, buf, file_size)
        except _HeaderOverrun:
            raise ValueError(
                f"{path} is truncated or corrupt: the GGUF header runs past the end of the file "
                f"({file_size} bytes)"
            ) from None
        except (UnicodeDecodeError, ValueError, KeyError, OverflowError, MemoryError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"{path} is corrupt: invalid GGUF header ({type(e).__name__}: {e})") from None
    _check_tensor_data_fits(header)
    return header


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse and validate a GGUF file's header (cached per path, size and mtime)."""
    path = os.path.abspath(path)
    st = os.stat(path)
    return _read_header_cached(path, st.st_size, st.st_mtime_ns)


# --------------------------------------------------------------------------- config


def _check_architecture(header: GGUFHeader) -> str:
    arch = header.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: unsupported architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if int(header.metadata.get("split.count", 1)) > 1:
        raise ValueError(f"{header.path}: split (multi-file) GGUF models are not supported")
    return arch


def _required(header: GGUFHeader, key: str) -> Any:
    try:
        return header.metadata[key]
    except KeyError:
        raise ValueError(f"{header.path} is missing GGUF metadata key {key!r}") from None


def _rope_parameters(header: GGUFHeader, arch: str) -> dict[str, Any]:
    meta = header.metadata
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        params.update(rope_type="linear", factor=float(_required(header, f"{arch}.rope.scaling.factor")))
    elif scaling == "yarn":
        params.update(
            rope_type="yarn",
            factor=float(_required(header, f"{arch}.rope.scaling.factor")),
            original_max_position_embeddings=int(_required(header, f"{arch}.rope.scaling.original_context_length")),
        )
    elif scaling != "none":
        raise ValueError(f"{header.path}: unsupported rope scaling type {scaling!r}")
    return params


def gguf_config(header: GGUFHeader) -> PretrainedConfig:
    """Build a transformers config (LlamaConfig / Qwen2Config / Qwen3Config) from GGUF metadata."""
    arch = _check_architecture(header)
    meta = header.metadata
    n_heads = int(_required(header, f"{arch}.attention.head_count"))
    hidden = int(_required(header, f"{arch}.embedding_length"))
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{header.path} has no token_embd.weight tensor")
    kwargs: dict[str, Any] = dict(
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=int(_required(header, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_required(header, f"{arch}.block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // n_heads)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(header, arch),
        tie_word_embeddings="output.weight" not in header.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    from transformers import Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Qwen2Config, Qwen3Config
    if arch == "gemma2":
        return Gemma2Config(**_gemma_settings(header, arch, kwargs))
    if arch == "gemma3":
        return Gemma3TextConfig(**_gemma_settings(header, arch, kwargs))
    if arch == "granite":
        return GraniteConfig(**kwargs, **{name: float(meta[key]) for name, key in (
            ("embedding_multiplier", "granite.embedding_scale"), ("residual_multiplier", "granite.residual_scale"),
            ("attention_multiplier", "granite.attention.scale"), ("logits_scaling", "granite.logit_scale"))
            if key in meta})
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)
    return Qwen3Config(**kwargs)


# Layer counts of the 27B models, whose attention scale llama.cpp takes from hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_settings(header: GGUFHeader, arch: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's and 3's settings that their GGUF metadata leaves to the reader, as llama.cpp reads them:
    every other layer (Gemma 2) or every sixth (Gemma 3) global, Gemma 3's local rope base 10000, the
    attention scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) in the 27B models), Gemma 2's soft caps."""
    meta = header.metadata
    window = meta.get(f"{arch}.attention.sliding_window")
    layers = kwargs["num_hidden_layers"]
    period = 2 if arch == "gemma2" else 6
    settings = dict(
        kwargs,
        sliding_window=int(window) if window else None,
        layer_types=["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)],
        query_pre_attn_scalar=(kwargs["hidden_size"] // kwargs["num_attention_heads"]
                               if layers == _GEMMA_27B_LAYERS[arch] else kwargs["head_dim"]),
        hidden_activation="gelu_pytorch_tanh",
    )
    if arch == "gemma3":
        settings["rope_parameters"] = {"full_attention": kwargs["rope_parameters"],
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    else:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            settings[key] = float(meta[f"gemma2.{key}"]) if f"gemma2.{key}" in meta else None
    return settings


# --------------------------------------------------------------------------- weights

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",   # qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms a layer: ffn_norm is the one before its MLP.
_GEMMA_BLOCK_TENSOR_NAMES = {
    **_BLOCK_TENSOR_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Not model parameters in HF terms (llama3 rope factors are a rope-scaling detail).
_IGNORED_TENSOR_NAMES = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name to its Hugging Face state-dict name (None: not a parameter)."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    if gguf_name in _IGNORED_TENSOR_NAMES:
        return None
    block_names = _GEMMA_BLOCK_TENSOR_NAMES if arch in ("gemma2", "gemma3") else _BLOCK_TENSOR_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def stores_norms_plus_one(arch: str) -> bool:
    """Whether llama.cpp's converter stored Gemma's norm weights as 1 + w (the reader gives back w)."""
    return arch in ("gemma2", "gemma3")


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> HF half-split rotary).

    The converter stored W' = W.reshape(n_head, 2, d/2, in).swapaxes(1, 2).reshape(out, in).
    """
    out_dim = weight.shape[0]
    return weight.reshape(n_head, out_dim // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rotary_head_counts(header: GGUFHeader) -> dict[str, int]:
    """Per GGUF tensor suffix, the head count used to permute it (empty if not permuted)."""
    arch = header.architecture
    if arch not in ("llama", "granite"):
        return {}  # qwen2/qwen3/gemma3 GGUFs keep HF's q/k layout
    n_head = int(header.metadata[f"{arch}.attention.head_count"])
    n_kv = int(header.metadata.get(f"{arch}.attention.head_count_kv", n_head))
    return {"attn_q.weight": n_head, "attn_k.weight": n_kv}


def _scales(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Each block's float16 at byte `at`, as a float32 column."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[blocks, n] bytes as [blocks, 2n] float32: the low nibbles, then the high ones (ggml's order)."""
    half = quants.shape[1]
    out = torch.empty(quants.shape[0], 2 * half)
    out[:, :half] = quants & 0x0F
    out[:, half:] = quants >> 4
    return out


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:  # d f16, 16 bytes of 4-bit q: d * (q - 8)
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(_scales(blocks, 0))


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:  # d f16, m f16, 16 bytes of 4-bit q: d * q + m
    return _nibbles(blocks[:, 4:]).mul_(_scales(blocks, 0)).add_(_scales(blocks, 2))


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:  # d f16, 32 int8 q: q * d
    return blocks[:, 2:].view(torch.int8).float().mul_(_scales(blocks, 0))


def _dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16).float()


def _dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.bfloat16).float()


# Each takes the tensor's bytes as [blocks, bytes per block] and gives [blocks, values per block];
# each operation and its order are gguf.quants' own, so the float32 values are the same bits.
_TORCH_DEQUANTIZERS = {
    GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    GGMLQuantizationType.Q4_1: _dequantize_q4_1,
    GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    GGMLQuantizationType.F16: _dequantize_f16,
    GGMLQuantizationType.BF16: _dequantize_bf16,
}


def _dequantize(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """A 1-D run of whole blocks of `info`'s type, as a 1-D float32 array."""
    decode = _TORCH_DEQUANTIZERS.get(info.qtype)
    if decode is not None:
        _, type_size = GGML_QUANT_SIZES[info.qtype]
        return decode(torch.from_numpy(raw).view(-1, type_size)).reshape(-1).numpy()
    try:
        return dequantize(raw, info.qtype)
    except NotImplementedError:
        raise ValueError(f"tensor {info.name}: GGUF type {info.qtype.name} cannot be dequantized") from None


def dequantize_tensor(file_bytes: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor `info` of a GGUF file (all its bytes, e.g. a memmap) as float32, in numpy order; a
    view of the file where it is stored as F32."""
    return _dequantize(file_bytes[info.offset : info.offset + info.n_bytes], info).reshape(info.shape)


def _row_view(file_bytes: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes as [rows, bytes per row] (a 1-D tensor is one row); nothing is read yet."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return file_bytes[info.offset : info.offset + info.n_bytes].reshape(rows, info.n_bytes // rows)


def _dequantize_rows(file_bytes: np.ndarray, info: GGUFTensorInfo, start: int, count: int) -> np.ndarray:
    """Rows [start, start + count) of a 2-D tensor: each row is a contiguous byte range, so only
    those bytes are read and dequantized."""
    raw = _row_view(file_bytes, info)[start : start + count]
    return _dequantize(raw.reshape(-1), info).reshape(count, *info.shape[1:])


def _dequantize_columns(file_bytes: np.ndarray, info: GGUFTensorInfo, start: int, count: int) -> np.ndarray:
    """Columns [start, start + count) of every row (the last dim)."""
    block_size, type_size = GGML_QUANT_SIZES[info.qtype]
    if start % block_size == 0 and count % block_size == 0:
        # Both ends on quant-block boundaries: each row's slice is whole blocks, read from its bytes.
        first, end = start // block_size * type_size, (start + count) // block_size * type_size
        raw = _row_view(file_bytes, info)[:, first:end]
        return _dequantize(np.ascontiguousarray(raw).reshape(-1), info).reshape(*info.shape[:-1], count)
    # An end inside a quant block: the block must be decoded whole, so the whole rows (here, the whole
    # tensor) are dequantized and the columns cut from them.
    return dequantize_tensor(file_bytes, info)[..., start : start + count]


# The span a page fault in a file mapping can map at once: Linux maps the pages around a fault
# (fault_around_bytes) or a whole large page-cache folio, both kept inside the fault's PMD, 2 MiB on
# x86-64 (kernel 6.18 mapped ~45 MB of a 94 MB file through 64 KiB windows: large folios).
_FAULT_SPAN = 2 << 20


class GGUFWeightReader:
    """A GGUF file's tensors by Hugging Face name, whole or one slice at a time, dequantized to float32
    (kestrel/model/loader.py `WeightReader`). A slice reads only its rows' bytes (its columns' bytes
    where they are whole quant blocks). Llama's q/k rows come back in Hugging Face's rotary layout:
    llama.cpp permuted rows within each head, so a row slice of them must be whole heads."""

    def __init__(self, path: str) -> None:
        header = read_gguf_header(path)
        arch = _check_architecture(header)
        self._permuted = _rotary_head_counts(header)
        self._norms_plus_one = stores_norms_plus_one(arch)
        # Copy-on-write, so that torch may view it (nothing writes to it; the file is never changed).
        with open(header.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._infos: dict[str, GGUFTensorInfo] = {}
        for info in header.tensors.values():
            name = hf_tensor_name(info.name, arch)
            if name is None:
                logger.warning("%s: ignoring GGUF tensor %s", header.path, info.name)
                continue
            self._infos[name] = info

    def names(self) -> list[str]:
        return list(self._infos)

    def read(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        info = self._infos[name]
        n_head = self._permuted.get(info.name.split(".", 2)[-1])
        if dim is None:
            array = dequantize_tensor(self._bytes, info)
        else:
            dim, size = self._slice(name, info, dim, start, size)
            if dim == len(info.shape) - 1:
                array = _dequantize_columns(self._bytes, info, start, size)
            elif dim == 0:
                n_head = self._rows_heads(name, info, n_head, start, size)
                array = _dequantize_rows(self._bytes, info, start, size)
            else:
                raise ValueError(f"{name}: slices of dim {dim} of a {len(info.shape)}-D tensor are not supported")
        if n_head is not None:
            array = unpermute_rotary(array, n_head)
        if self._norms_plus_one and info.name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        if np.may_share_memory(array, self._bytes):  # F32 data is a view of the read-only mmap
            array = array.copy()
        self._unmap_pages(info)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

    def block_types(self) -> dict[str, str]:
        """Each matrix's GGUF type by name ("Q4_K", "F16", ...): read_blocks returns the file's bytes of any."""
        return {name: info.qtype.name for name, info in self._infos.items() if len(info.shape) == 2}

    def read_blocks(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        """A matrix [N, K] (whole, or the slice `read` would give: rows, or columns on whole blocks of its
        type) as the file's bytes, uint8 [rows, K / block * block bytes], q/k rows in Hugging Face's
        rotary layout as `read` gives them."""
        info = self._infos[name]
        if len(info.shape) != 2:
            raise ValueError(f"{name} is {info.qtype.name} {list(info.shape)}, not a matrix")
        n_head = self._permuted.get(info.name.split(".", 2)[-1])
        rows = _row_view(self._bytes, info)
        block, block_bytes = GGML_QUANT_SIZES[info.qtype]
        if dim is not None:
            dim, size = self._slice(name, info, dim, start, size)
            if dim == 0:
                n_head = self._rows_heads(name, info, n_head, start, size)
                rows = rows[start : start + size]
            elif start % block or size % block:
                raise ValueError(f"{name}: columns [{start}, {start + size}) are not whole "
                                 f"{info.qtype.name} blocks of {block}")
            else:
                rows = rows[:, start // block * block_bytes : (start + size) // block * block_bytes]
        if n_head is not None:
            rows = unpermute_rotary(rows, n_head)
        blocks = torch.from_numpy(np.array(rows, dtype=np.uint8))   # a copy: the rows leave the mmap
        self._unmap_pages(info)
        return blocks

    def _unmap_pages(self, info: GGUFTensorInfo) -> None:
        """Drop the file pages of a tensor just copied out from this process's memory (they stay in the
        page cache). Otherwise every page read stays in the process's RSS while the reader lives, and a
        load peaked at the file's size above the weights it builds. The range is the tensor's, widened
        to the `_FAULT_SPAN`-aligned addresses around it, all that its faults can have mapped; a later
        read faults back in any of a neighbour's pages it takes."""
        base = self._bytes.ctypes.data
        first = max(0, (base + info.offset) // _FAULT_SPAN * _FAULT_SPAN - base)
        end = min(-(-(base + info.offset + info.n_bytes) // _FAULT_SPAN) * _FAULT_SPAN - base, len(self._map))
        if hasattr(mmap, "MADV_DONTNEED") and end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    @staticmethod
    def _slice(name: str, info: GGUFTensorInfo, dim: int, start: int, size: int | None) -> tuple[int, int]:
        """(dim, size) of a slice of `info`'s tensor (a negative dim counted from the end, size None: to
        the end), checked to lie inside it."""
        dim = dim % len(info.shape)
        size = info.shape[dim] - start if size is None else size
        if not (0 <= start and size > 0 and start + size <= info.shape[dim]):
            raise ValueError(f"{name}: slice [{start}, {start + size}) of dim {dim} is outside {info.shape}")
        return dim, size

    @staticmethod
    def _rows_heads(name: str, info: GGUFTensorInfo, n_head: int | None, start: int, size: int) -> int | None:
        """The heads a row slice of a permuted q/k covers (None: not permuted)."""
        if n_head is None:
            return None
        head_dim = info.shape[0] // n_head
        if start % head_dim or size % head_dim:
            raise ValueError(f"{name}: rows [{start}, {start + size}) are not whole heads of {head_dim} rows")
        return size // head_dim


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor) for each GGUF tensor, one at a time."""
    reader = GGUFWeightReader(path)
    for name in reader.names():
        yield name, reader.read(name)


# --------------------------------------------------------------------------- tokenizer


def kestrel_cache_dir() -> Path:
    return envs.KESTREL_CACHE_DIR


def _tokenizer_cache_key(gguf_path: str) -> str:
    import transformers

    st = os.stat(gguf_path)
    name = os.path.basename(gguf_path)
    digest = hashlib.sha256(f"{name}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    return f"{name.removesuffix('.gguf')}-{digest[:16]}"


def _convert_gguf_tokenizer(folder: str, gguf_file: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)  # atomic; fails if another process won the race
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_tokenizer(folder: str, gguf_file: str) -> PreTrainedTokenizerBase:
    """Tokenizer from GGUF metadata; the ~6 s conversion is cached with save_pretrained."""
    from transformers import AutoTokenizer

    gguf_path = os.path.join(folder, gguf_file)
    read_gguf_header(gguf_path)  # clear error for corrupt files before transformers sees them
    cached = kestrel_cache_dir() / "tokenizers" / _tokenizer_cache_key(gguf_path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached, local_files_only=True)
        except Exception as e:  # a damaged cache entry must not block loading
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _convert_gguf_tokenizer(folder, gguf_file)
    try:
        _save_atomically(tokenizer, cached)
    except OSError as e:
        logger.warning("could not cache tokenizer in %s: %s", cached, e)
    return tokenizer
