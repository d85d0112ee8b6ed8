"""Hugging Face model folders: config.json + *.safetensors + tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

# transformers is imported where it is used (why: kestrel/model/loader.py).
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# kestrel.model.ARCHITECTURES' keys
SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "granite", "phi3")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def is_hf_folder(folder: str | os.PathLike[str]) -> bool:
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def safetensors_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The weight files, per the shard index when present.

    Some repos (e.g. Mistral) also ship a consolidated.safetensors with the same
    weights under different names; the index says which files are the HF ones.
    """
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    return sorted(folder.glob("*.safetensors"))


def hf_config(folder: str) -> PretrainedConfig:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise ValueError(
            f"{folder}: unsupported model_type {config.model_type!r}; supported: "
            f"{', '.join(SUPPORTED_HF_MODEL_TYPES)}"
        )
    return config


class SafetensorsReader:
    """A folder's safetensors tensors by name, whole or one slice at a time, in their stored dtype
    (kestrel/model/loader.py `WeightReader`); a slice reads only its own bytes.

    Each read opens its file and closes it after: safetensors maps the file, and the pages a read
    touches stay in this process's memory while a handle on it is open, so that a load held the
    checkpoint's size in file pages above the weights it built (a 4.5 GB peak for a 2.2 GB model).
    Opening a file costs parsing its header, ~1 ms. The tensors view the file: the model copies them."""

    def __init__(self, folder: str) -> None:
        self._file_of: dict[str, Path] = {}
        for file in safetensors_files(folder):
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    self._file_of[name] = file

    def names(self) -> list[str]:
        return list(self._file_of)

    def read(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt", device="cpu") as handle:
            if dim is None:
                return handle.get_tensor(name)
            tensor = handle.get_slice(name)
            shape = tensor.get_shape()
            dim = dim % len(shape)
            end = shape[dim] if size is None else start + size
            if not 0 <= start < end <= shape[dim]:
                raise ValueError(f"{name}: slice [{start}, {end}) of dim {dim} is outside {tuple(shape)}")
            return tensor[tuple(slice(start, end) if d == dim else slice(None) for d in range(len(shape)))]


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in stored dtype, one tensor at a time."""
    reader = SafetensorsReader(folder)
    for name in reader.names():
        yield name, reader.read(name)


def hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
