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

SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen3")  # mistral runs as llama-like
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
    (kestrel/model/loader.py `WeightReader`); a slice reads only its own bytes."""

    def __init__(self, folder: str) -> None:
        self._file_of: dict[str, object] = {}
        for file in safetensors_files(folder):
            handle = safe_open(file, framework="pt", device="cpu")
            for name in handle.keys():
                self._file_of[name] = handle

    def names(self) -> list[str]:
        return list(self._file_of)

    def read(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        handle = self._file_of[name]
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
