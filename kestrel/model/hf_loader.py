"""Hugging Face model folders: config.json + *.safetensors + tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

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
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in SUPPORTED_HF_MODEL_TYPES:
        raise ValueError(
            f"{folder}: unsupported model_type {config.model_type!r}; supported: "
            f"{', '.join(SUPPORTED_HF_MODEL_TYPES)}"
        )
    return config


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in stored dtype, one tensor at a time."""
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
