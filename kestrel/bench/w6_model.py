"""W6's model (bench/WORKLOADS.md): a Llama of TinyLlama-1.1B's shape with random weights, generated
here once (there is no model hub) so that every engine reads the same weights.

`w6_model(shape)` writes, once, into `<kestrel cache>/models/<tag>-<key>/` (the key hashes the
recipe: the shape, the seed, the scales, the tokenizer's source and RECIPE_VERSION; the entry is
written into a temp folder and renamed, so a reader sees all of it or none):

    <tag>/                  a Hugging Face folder: config.json (LlamaConfig, untied output head),
                            one safetensors shard per decoder layer plus one for the embeddings and one
                            for the final norm and output head (model.safetensors.index.json), the
                            tokenizer files; every weight in bf16
    <tag>.BF16.gguf         the same bf16 weights and tokenizer for llama.cpp: the llama
                            architecture's q/k rows permuted as llama.cpp's converter does (Kestrel's
                            GGUF loader undoes it), norms in f32 as the converter writes them (bf16
                            values, so nothing is rounded)

`quantized_gguf(model, "Q8_0" | "Q4_K_M" | "Q5_K_M")` runs llama.cpp's `llama-quantize` on the bf16 file, once,
into the same folder (temp file + rename).

Weights: one `torch.Generator` seeded with SEED draws every tensor in a fixed order: matrices
N(0, WEIGHT_STD), RMS norms 1 + N(0, NORM_STD), all rounded to bf16. The GGUF file is written from
the safetensors shards, tensor by tensor, so the two hold the same values by construction; at most
one tensor (the largest, the embedding) is in memory at a time.

Tokenizer: the default model's (SmolLM2, a GPT-2 style byte-level BPE of 49152 tokens) cut to the
first `vocab_size` ids, keeping only the merges whose two parts and result are all kept. Its first
ids are the special tokens and the single bytes, and the merges are in the order their results
were added, so the cut is a working BPE tokenizer of its own. The GGUF file carries it as llama.cpp
reads it (tokens, types, merges, pre-tokenizer "smollm"); the folder's tokenizer files are
transformers' conversion of that GGUF metadata, so Kestrel (either file), transformers and
llama.cpp split text the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kestrel.bench.common import log

RECIPE_VERSION = 1
SEED = 0
WEIGHT_STD = 0.02
NORM_STD = 0.02
QUANT_TYPES = ("Q8_0", "Q4_K_M", "Q5_K_M")   # what llama-quantize is asked for
QUANTIZE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama-architecture model; the defaults are TinyLlama-1.1B's."""

    hidden_size: int = 2048
    num_hidden_layers: int = 22
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    intermediate_size: int = 5632
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def tag(self) -> str:
        return (f"random-llama-h{self.hidden_size}-l{self.num_hidden_layers}-a{self.num_attention_heads}"
                f"-kv{self.num_key_value_heads}-f{self.intermediate_size}-v{self.vocab_size}")


TINYLLAMA_SHAPE = LlamaShape()


@dataclass(frozen=True)
class W6Model:
    """The files of one generated model (see the module docstring for the layout)."""

    folder: Path
    shape: LlamaShape

    @property
    def hf_folder(self) -> Path:
        return self.folder / self.shape.tag

    @property
    def bf16_gguf(self) -> Path:
        return self.folder / f"{self.shape.tag}.BF16.gguf"

    def quantized_path(self, quant_type: str) -> Path:
        return self.folder / f"{self.shape.tag}.{quant_type}.gguf"


# ---- the recipe key and the cache entry --------------------------------------------------------

def tokenizer_source() -> Path:
    from kestrel.model.loader import default_model_path
    return default_model_path()


def recipe_key(shape: LlamaShape, source: Path | None = None) -> str:
    """A hash of everything the files depend on: another recipe makes another folder."""
    source = tokenizer_source() if source is None else source
    recipe = {"version": RECIPE_VERSION, "shape": asdict(shape), "seed": SEED, "weight_std": WEIGHT_STD,
              "norm_std": NORM_STD, "tokenizer": [source.name, source.stat().st_size]}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def w6_model(shape: LlamaShape = TINYLLAMA_SHAPE, cache_dir: Path | None = None) -> W6Model:
    """The generated model of `shape`, written the first time it is asked for (with a log line: for
    TinyLlama's shape, 4.4 GB in about 15 s on 2 Zen 4 cores) and reused after."""
    from kestrel.model.gguf_loader import kestrel_cache_dir

    root = (kestrel_cache_dir() if cache_dir is None else Path(cache_dir)) / "models"
    model = W6Model(root / f"{shape.tag}-{recipe_key(shape)}", shape)
    if model.bf16_gguf.is_file():
        return model
    log(f"generating the random-weight model {shape.tag} into {model.folder} (once; this takes a while)")
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.folder.name}.", dir=root))
    try:
        write_model(W6Model(tmp, shape))
        os.rename(tmp, model.folder)  # atomic; fails if another process finished first
    except OSError:
        if not model.bf16_gguf.is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"generated {shape.tag} in {time.perf_counter() - start:.0f} s")
    return model


def write_model(model: W6Model) -> None:
    """Every file of the entry into `model.folder` (which exists)."""
    model.hf_folder.mkdir()
    tokenizer = cut_tokenizer(tokenizer_source(), model.shape.vocab_size)
    write_hf_config(model.hf_folder, model.shape, tokenizer)
    write_safetensors_shards(model.hf_folder, model.shape)
    write_bf16_gguf(model.bf16_gguf, model.hf_folder, model.shape, tokenizer)
    save_hf_tokenizer(model.bf16_gguf, model.hf_folder)


# ---- tokenizer ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFTokenizer:
    """A GPT-2 style BPE tokenizer as GGUF metadata holds it."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_token_id: int
    eos_token_id: int
    unknown_token_id: int
    padding_token_id: int
    chat_template: str | None


def cut_tokenizer(source: Path, vocab_size: int) -> GGUFTokenizer:
    """The source GGUF's tokenizer cut to its first `vocab_size` ids, with the merges that stay whole."""
    from kestrel.model.gguf_loader import read_gguf_header

    meta = read_gguf_header(source).metadata
    if (kind := meta.get("tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"{source}: expected a gpt2 (byte-level BPE) tokenizer, got {kind!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    if not 0 < vocab_size <= len(tokens):
        raise ValueError(f"vocab_size must be in 1..{len(tokens)} (the source's vocabulary), got {vocab_size}")
    kept = tokens[:vocab_size]
    kept_set = set(kept)
    merges = [m for m in meta["tokenizer.ggml.merges"]
              if all(part in kept_set for part in (*m.split(" "), m.replace(" ", "")))]
    special_ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown", "padding")]
    if max(special_ids) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} drops a special token (ids {special_ids})")
    return GGUFTokenizer(tokens=kept, token_types=meta["tokenizer.ggml.token_type"][:vocab_size], merges=merges,
                         pre=meta["tokenizer.ggml.pre"], bos_token_id=special_ids[0], eos_token_id=special_ids[1],
                         unknown_token_id=special_ids[2], padding_token_id=special_ids[3],
                         chat_template=meta.get("tokenizer.chat_template"))


def save_hf_tokenizer(gguf_path: Path, hf_folder: Path) -> None:
    """transformers' conversion of the GGUF file's tokenizer, saved as the folder's tokenizer files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(hf_folder)


# ---- weights ------------------------------------------------------------------------------------

def layer_tensor_shapes(shape: LlamaShape) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name suffix, shape) of one decoder layer's tensors, in the order they are drawn."""
    h, q, kv, f = (shape.hidden_size, shape.num_attention_heads * shape.head_dim,
                   shape.num_key_value_heads * shape.head_dim, shape.intermediate_size)
    return [("input_layernorm.weight", (h,)), ("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q)),
            ("post_attention_layernorm.weight", (h,)), ("mlp.gate_proj.weight", (f, h)),
            ("mlp.up_proj.weight", (f, h)), ("mlp.down_proj.weight", (h, f))]


def shard_plan(shape: LlamaShape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors of each safetensors shard, in draw order: the embeddings, each layer, then the
    final norm and the output head."""
    shards = [[("model.embed_tokens.weight", (shape.vocab_size, shape.hidden_size))]]
    for i in range(shape.num_hidden_layers):
        shards.append([(f"model.layers.{i}.{name}", dims) for name, dims in layer_tensor_shapes(shape)])
    shards.append([("model.norm.weight", (shape.hidden_size,)),
                   ("lm_head.weight", (shape.vocab_size, shape.hidden_size))])
    return shards


def random_tensor(dims: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A matrix N(0, WEIGHT_STD) or a norm 1 + N(0, NORM_STD), in bf16."""
    values = torch.randn(dims, generator=generator, dtype=torch.float32)
    if len(dims) == 1:
        return (1.0 + NORM_STD * values).bfloat16()
    return values.mul_(WEIGHT_STD).bfloat16()


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_safetensors_shards(folder: Path, shape: LlamaShape) -> None:
    """The weights as safetensors shards with their index, one shard in memory at a time."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(SEED)
    plan = shard_plan(shape)
    weight_map, total_size = {}, 0
    for index, tensors in enumerate(plan):
        shard = {name: random_tensor(dims, generator) for name, dims in tensors}
        save_file(shard, folder / shard_name(index, len(plan)), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = shard_name(index, len(plan))
            total_size += tensor.numel() * tensor.element_size()
    index_doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")


def write_hf_config(folder: Path, shape: LlamaShape, tokenizer: GGUFTokenizer) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta}, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.padding_token_id, dtype="bfloat16",
    ).save_pretrained(folder)


# ---- GGUF ---------------------------------------------------------------------------------------

_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    """The inverse of kestrel/model/gguf_loader.py's hf_tensor_name, for the tensors written here."""
    from kestrel.model.gguf_loader import _BLOCK_TENSOR_NAMES

    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)
    gguf_suffix = {v: k for k, v in _BLOCK_TENSOR_NAMES.items()}[suffix]
    return f"blk.{layer}.{gguf_suffix}"


def permute_rotary(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (HF half-split rotary -> interleaved), as its converter
    applies it: per head, rows viewed as (2, d/2) are stored as (d/2, 2)."""
    out_dim = weight.shape[0]
    return weight.reshape(n_head, 2, out_dim // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _permute_heads(hf_name: str, shape: LlamaShape) -> int | None:
    if hf_name.endswith("self_attn.q_proj.weight"):
        return shape.num_attention_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return shape.num_key_value_heads
    return None


def _gguf_data(hf_name: str, tensor: torch.Tensor, shape: LlamaShape) -> np.ndarray:
    """A tensor's bytes as llama.cpp wants them: 1-D in f32, 2-D in bf16 (as uint16 words)."""
    if tensor.dim() == 1:
        return tensor.float().numpy()
    n_head = _permute_heads(hf_name, shape)
    if n_head is not None:
        tensor = permute_rotary(tensor, n_head)
    return tensor.contiguous().view(torch.uint16).numpy()


def write_bf16_gguf(path: Path, hf_folder: Path, shape: LlamaShape, tokenizer: GGUFTokenizer) -> None:
    """The folder's weights and the tokenizer as a llama-architecture GGUF file, tensor by tensor."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    from kestrel.model.hf_loader import SafetensorsReader

    writer = GGUFWriter(path, arch="llama")
    _add_model_metadata(writer, shape, LlamaFileType.MOSTLY_BF16)
    _add_tokenizer_metadata(writer, tokenizer)
    # The header needs every tensor's size first; the data then follows one tensor at a time.
    plan = [tensor for shard in shard_plan(shape) for tensor in shard]
    for name, dims in plan:
        raw, size = (GGMLQuantizationType.F32, 4) if len(dims) == 1 else (GGMLQuantizationType.BF16, 2)
        writer.add_tensor_info(gguf_tensor_name(name), dims, np.dtype(np.float32), int(np.prod(dims)) * size,
                               raw_dtype=raw)
    reader = SafetensorsReader(str(hf_folder))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, _ in plan:
            writer.write_tensor_data(_gguf_data(name, reader.read(name), shape))
        writer.flush()
    finally:
        writer.close()


def _add_model_metadata(writer: Any, shape: LlamaShape, file_type: int) -> None:
    writer.add_name(shape.tag)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type(int(file_type))


def _add_tokenizer_metadata(writer: Any, tokenizer: GGUFTokenizer) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    writer.add_token_merges(tokenizer.merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unknown_token_id)
    writer.add_pad_token_id(tokenizer.padding_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


# ---- llama-quantize -----------------------------------------------------------------------------

def quantized_gguf(model: W6Model, quant_type: str, binary: Path | None = None) -> Path:
    """llama-quantize's `quant_type` file of the model's bf16 GGUF, made the first time."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"unknown quantization {quant_type!r}; expected one of {', '.join(QUANT_TYPES)}")
    target = model.quantized_path(quant_type)
    if target.is_file():
        return target
    if binary is None:
        from kestrel.bench.peers import llama_quantize_binary
        binary = llama_quantize_binary()
    log(f"llama-quantize: {model.bf16_gguf.name} -> {target.name}")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=model.folder)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        threads = str(len(os.sched_getaffinity(0)))
        proc = subprocess.run([str(binary), str(model.bf16_gguf), str(tmp), quant_type, threads],
                              capture_output=True, text=True, timeout=QUANTIZE_TIMEOUT_S)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise RuntimeError(f"llama-quantize failed (exit status {proc.returncode}):\n{tail}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
