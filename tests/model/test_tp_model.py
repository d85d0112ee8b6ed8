"""Tensor- and pipeline-parallel sharding of the model (kestrel/model/sharding.py, kestrel/model/llama.py)
and the sliced weight readers (kestrel/model/loader.py).

The distributed tests spawn one process per rank (gloo on CPU), build each rank's shard of tiny
random-weight models whose head counts do and do not divide by the number of ranks, run a prefill
and compare the logits of the sampling rank with the unsharded model's.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kestrel.attention import CommonAttentionMetadata, PrefillSpan
from kestrel.config import ModelConfig
from kestrel.distributed import GroupCoordinator
from kestrel.model import IntermediateTensors, build_model, check_shardable, model_config_from_hf, shard_for
from kestrel.model.decode_plan import DecodePlan
from kestrel.model.loader import default_model_path, load_config, resolve_model, weight_reader

os.environ["HF_HUB_OFFLINE"] = "1"

VOCAB = 1001   # odd: the vocabulary splits unevenly at tp 2 and 3, so the logits gather drops padding
SPANS = [(0, 13), (13, 21)]   # two prompts in one prefill step
NUM_TOKENS = SPANS[-1][1]


# ---- shard_for: pure arithmetic ----------------------------------------------------------------

def _config(heads: int = 9, kv_heads: int = 3, layers: int = 30, vocab: int = 49152, inter: int = 1536,
            head_dim: int = 64) -> ModelConfig:
    """The default model's shapes (SmolLM2-135M) unless told otherwise."""
    return ModelConfig(model=None, architecture="llama", vocab_size=vocab, hidden_size=576, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
                       tie_word_embeddings=True, attention_bias=False, qk_norm=False, eos_token_id=2,
                       bos_token_id=1, dtype=torch.float32, max_model_len=64)


def _tp_shards(cfg: ModelConfig, tp: int) -> list:
    return [shard_for(cfg, r, tp, 0, 1) for r in range(tp)]


def test_default_model_at_tp2_splits_whole_kv_groups() -> None:
    shards = _tp_shards(_config(), 2)
    assert [(s.head_start, s.num_heads) for s in shards] == [(0, 6), (6, 3)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in shards] == [(0, 2), (2, 1)]
    assert [(s.intermediate_start, s.intermediate_size) for s in shards] == [(0, 768), (768, 768)]
    assert [(s.vocab_start, s.vocab_size, s.vocab_shard_rows) for s in shards] == [(0, 24576, 24576),
                                                                                    (24576, 24576, 24576)]


def test_default_model_at_tp3_one_kv_head_each() -> None:
    shards = _tp_shards(_config(), 3)
    assert [(s.head_start, s.num_heads) for s in shards] == [(0, 3), (3, 3), (6, 3)]
    assert [(s.kv_head_start, s.num_kv_heads) for s in shards] == [(0, 1), (1, 1), (2, 1)]
    assert [s.intermediate_size for s in shards] == [512, 512, 512]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    shards = _tp_shards(_config(heads=4, kv_heads=1), 2)
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads) for s in shards] == [(0, 2, 0, 1),
                                                                                            (2, 2, 0, 1)]
    shards = _tp_shards(_config(heads=6, kv_heads=2), 4)   # 3 q heads per KV head, 2 ranks per KV head
    assert [(s.head_start, s.num_heads, s.kv_head_start) for s in shards] == [(0, 2, 0), (2, 1, 0), (3, 2, 1),
                                                                              (5, 1, 1)]


def test_kv_heads_not_dividing_ranks_split_the_q_heads_evenly() -> None:
    # 6 heads, 2 KV heads at tp 3: the middle rank takes one q head of each KV head (a uniform group of 1).
    shards = _tp_shards(_config(heads=6, kv_heads=2), 3)
    assert [(s.head_start, s.num_heads, s.kv_head_start, s.num_kv_heads) for s in shards] == [
        (0, 2, 0, 1), (2, 2, 0, 2), (4, 2, 1, 1)]


def test_uneven_vocab_pads_logits_to_the_largest_shard() -> None:
    shards = _tp_shards(_config(vocab=VOCAB), 3)
    assert [(s.vocab_start, s.vocab_size) for s in shards] == [(0, 334), (334, 334), (668, 333)]
    assert {s.vocab_shard_rows for s in shards} == {334}


def test_pipeline_stages_get_contiguous_layers_earlier_ones_more() -> None:
    stages = [shard_for(_config(layers=30), 0, 1, r, 4) for r in range(4)]
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stages[0].is_first_stage and not stages[0].is_last_stage and stages[3].is_last_stage
    assert sum(s.num_layers for s in stages) == 30


@pytest.mark.parametrize(("cfg", "tp", "pp", "match"), [
    (_config(heads=8, kv_heads=2), 3, 1, "cannot split 8 attention heads with 2 KV heads between 3"),
    (_config(heads=2, kv_heads=1), 4, 1, "cannot split 2 attention heads with 1 KV heads between 4"),
    (_config(heads=9, kv_heads=3), 2, 31, "cannot split the model's 30 decoder layers between 31 pipeline"),
    (_config(inter=2), 3, 1, "cannot split the model's 2 intermediate rows between 3"),
])
def test_impossible_splits_are_refused_clearly(cfg: ModelConfig, tp: int, pp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_shardable(cfg, tp, pp)


def test_one_rank_holds_everything_and_the_decode_plan_only_then() -> None:
    cfg = _config()
    whole = shard_for(cfg, 0, 1, 0, 1)
    assert (whole.num_heads, whole.num_kv_heads, whole.intermediate_size, whole.vocab_size, whole.num_layers) == (
        9, 3, 1536, 49152, 30)
    assert not whole.is_sharded and whole.kv_bytes_per_token(cfg) == cfg.kv_bytes_per_token()
    sharded = shard_for(cfg, 1, 2, 1, 2)
    assert sharded.kv_bytes_per_token(cfg) == 2 * 15 * 1 * 64 * 4
    assert DecodePlan.build(SimpleNamespace(shard=sharded, cfg=cfg), attn=None) is None


# ---- tiny checkpoints ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    kind: str              # llama | qwen2 | qwen3 | granite | phi3 | gemma2 | gemma3
    heads: int
    kv_heads: int
    tie: bool = True
    bias: bool = False
    gguf: bool = False     # saved as GGUF (llama's q/k permuted rows) instead of safetensors


def _hf_config(case: Case):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )
    common = dict(vocab_size=VOCAB, hidden_size=144, intermediate_size=100, num_hidden_layers=3,
                  num_attention_heads=case.heads, num_key_value_heads=case.kv_heads, head_dim=16,
                  max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=case.tie)
    windowed = dict(common, sliding_window=8, pad_token_id=0)   # shorter than the prefill spans
    if case.kind == "gemma3":
        return Gemma3TextConfig(**windowed, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if case.kind == "gemma2":
        return Gemma2Config(**windowed, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    if case.kind == "phi3":   # the checkpoint's fused qkv_proj and gate_up_proj, read in per-rank parts
        del common["head_dim"]
        return Phi3Config(**common, pad_token_id=0)
    if case.kind == "granite":
        return GraniteConfig(**common, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0625, logits_scaling=2.0)
    if case.kind == "qwen3":
        return Qwen3Config(**common)
    if case.kind == "qwen2":   # q, k and v with biases, sharded with their rows
        return Qwen2Config(**common)
    return LlamaConfig(**common, attention_bias=case.bias)


def _save(case: Case, folder: Path) -> str:
    """A random-weight model of `case` (norms too, so a mix-up shows) saved to `folder`; its path."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(case), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.08)
    if case.gguf:
        from tests.model.test_loader import write_tiny_gguf
        write_tiny_gguf(model, folder / "tiny.gguf", case.kind)
        return str(folder / "tiny.gguf")
    if not case.bias:
        model.save_pretrained(folder)
        return str(folder)
    # Kestrel's Llama takes the q/k/v biases only (as Qwen2-style checkpoints have them), not HF's o_proj bias.
    from safetensors.torch import save_file
    weights = {k: v.contiguous() for k, v in model.state_dict().items()
               if not k.endswith("o_proj.bias") and not (case.tie and k == "lm_head.weight")}
    model.config.save_pretrained(folder)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def _model_config(path: str) -> ModelConfig:
    return model_config_from_hf(load_config(resolve_model(path)), model=path, dtype=torch.float32,
                                max_model_len=64, eos_token_id=2, bos_token_id=1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(end - start) for start, end in SPANS])
    return ids, positions


def _prefill_metadata(attn) -> object:
    """The attention metadata of a prefill without a KV cache, as the runner's profile run builds it."""
    spans = [PrefillSpan(start, end, 0, np.zeros(0, dtype=np.int64)) for start, end in SPANS]
    common = CommonAttentionMetadata(torch.zeros(NUM_TOKENS, dtype=torch.long), 16, 0,
                                     torch.zeros((0, 0), dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                     np.zeros(0, dtype=np.int64), spans)
    return attn.build_metadata(common)


def _load(path: str) -> torch.nn.Module:
    model = build_model(_model_config(path), torch.device("cpu"))
    model.load_weights(weight_reader(resolve_model(path)))
    return model


def _unsharded_logits(path: str) -> torch.Tensor:
    model = _load(path)
    ids, positions = _inputs()
    return model.compute_logits(model(ids, positions, None, _prefill_metadata(model.attn)))


# ---- one process per rank -----------------------------------------------------------------------

def _rank_main(rank: int, tp: int, pp: int, init_method: str, paths: dict[str, str], out: str) -> None:
    """One rank: its shard of every model, a prefill through the pipeline, the logits saved by the
    sampling rank (tensor rank 0 of the last stage)."""
    from kestrel.distributed import destroy_distributed_environment, get_pp_group, init_distributed_environment
    torch.set_num_threads(1)
    init_distributed_environment(rank, tp, pp, init_method)
    try:
        for name, path in paths.items():
            _run_case(name, path, out, get_pp_group())
    finally:
        destroy_distributed_environment()


def _run_case(name: str, path: str, out: str, pp: GroupCoordinator) -> None:
    model = _load(path)
    shard = model.shard
    ids, positions = _inputs()
    intermediate = None
    if not shard.is_first_stage:
        intermediate = IntermediateTensors(*(pp.recv(torch.empty(NUM_TOKENS, model.cfg.hidden_size), pp.prev_rank)
                                             for _ in range(2)))
    result = model(ids, positions, None, _prefill_metadata(model.attn), intermediate)
    if not shard.is_last_stage:
        assert isinstance(result, IntermediateTensors)
        pp.send(result.hidden, pp.next_rank)
        pp.send(result.residual, pp.next_rank)
        return
    logits = model.compute_logits(result)
    if shard.tp_rank == 0:
        torch.save(logits, Path(out) / f"{name}.pt")
    else:
        assert logits is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_world(tp: int, pp: int, cases: list[Case], tmp_path: Path, exact: bool = False) -> None:
    paths = {}
    for case in cases:
        folder = tmp_path / case.name
        folder.mkdir()
        paths[case.name] = _save(case, folder)
    _check_paths(tp, pp, paths, tmp_path, exact)


def _check_paths(tp: int, pp: int, paths: dict[str, str], tmp_path: Path, exact: bool = False,
                 atol: float = 2e-5) -> None:
    """Every model of `paths` sharded tp x pp gives the unsharded model's logits."""
    out = tmp_path / "logits"
    out.mkdir()
    mp.start_processes(_rank_main, args=(tp, pp, f"tcp://127.0.0.1:{_free_port()}", paths, str(out)),
                       nprocs=tp * pp, join=True, start_method="spawn")
    for name, path in paths.items():
        expected = _unsharded_logits(path)
        got = torch.load(out / f"{name}.pt")
        assert got.shape == expected.shape, name
        if exact:   # no all-reduce: the same ops in the same order
            assert torch.equal(got, expected), name
        else:       # an all-reduce sums in another order than one matmul
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


TP2_CASES = [
    Case("llama-6-2-tied", "llama", 6, 2),
    Case("llama-4-1-bias", "llama", 4, 1, tie=False, bias=True),    # the KV head replicated on both ranks
    Case("llama-9-3", "llama", 9, 3),                                # heads (6, 3), KV heads (2, 1)
    Case("qwen3-6-2", "qwen3", 6, 2, tie=False),
    Case("gguf-llama-6-2", "llama", 6, 2, gguf=True),               # q/k rows read per head, unpermuted locally
    Case("gguf-qwen2-6-2", "qwen2", 6, 2, gguf=True),               # the biases from the file, per rank
    Case("granite-6-2", "granite", 6, 2),
    Case("phi3-6-2", "phi3", 6, 2, tie=False),
    Case("gemma2-6-2", "gemma2", 6, 2),
    Case("gemma3-6-2", "gemma3", 6, 2),
]
TP3_CASES = [
    Case("llama-6-2", "llama", 6, 2, tie=False),                     # heads (2, 2, 2), the middle rank's KV (0, 1)
    Case("llama-9-3-bias", "llama", 9, 3, bias=True),
    Case("qwen3-6-3", "qwen3", 6, 3),
    Case("gguf-llama-9-3", "llama", 9, 3, gguf=True),
]
PP_CASES = [
    Case("llama-6-2-tied", "llama", 6, 2),      # the last stage reads the embedding into its own lm_head
    Case("qwen3-4-2", "qwen3", 4, 2, tie=False),
]


@pytest.mark.slow
def test_tensor_parallel_2_matches_unsharded(tmp_path: Path) -> None:
    _check_world(2, 1, TP2_CASES, tmp_path)


@pytest.mark.slow
def test_tensor_parallel_3_matches_unsharded(tmp_path: Path) -> None:
    _check_world(3, 1, TP3_CASES, tmp_path)


@pytest.mark.slow
def test_pipeline_parallel_2_is_bit_identical(tmp_path: Path) -> None:
    _check_world(1, 2, PP_CASES, tmp_path, exact=True)


@pytest.mark.slow
def test_tensor_2_by_pipeline_2_matches_unsharded(tmp_path: Path) -> None:
    _check_world(2, 2, PP_CASES + [Case("llama-9-3", "llama", 9, 3)], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2])  # TP=3 on the default model: test_parity_default_model
def test_default_model_matches_unsharded(tmp_path: Path, tp: int) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads, tied embeddings, Q4_1/Q8_0 GGUF) at tp 2 (heads 6 + 3)."""
    # 30 layers of all-reduces in another order than one matmul: logits of magnitude ~10 move by ~1e-4.
    _check_paths(tp, 1, {"default": str(default_model_path())}, tmp_path, atol=5e-4)


# ---- loading only this rank's share -------------------------------------------------------------

class RecordingReader:
    """A WeightReader that records what is read."""

    def __init__(self, reader) -> None:
        self.reader, self.reads = reader, []

    def names(self) -> list[str]:
        return self.reader.names()

    def read(self, name: str, dim: int | None = None, start: int = 0, size: int | None = None) -> torch.Tensor:
        self.reads.append((name, dim, start, size))
        return self.reader.read(name, dim, start, size)


def _as_rank(monkeypatch, tp_rank: int, tp: int, pp_rank: int, pp: int) -> None:
    """Build models as this rank of a world (no collectives are made: only the shard is looked up)."""
    import kestrel.model.llama as llama
    import kestrel.model.sharding as sharding
    tp_group, pp_group = GroupCoordinator(list(range(tp)), tp_rank), GroupCoordinator(list(range(pp)), pp_rank)
    monkeypatch.setattr(sharding, "get_tp_group", lambda: tp_group)
    monkeypatch.setattr(sharding, "get_pp_group", lambda: pp_group)
    monkeypatch.setattr(llama, "get_tp_group", lambda: tp_group)


@pytest.mark.parametrize("gguf", [False, True])
def test_a_rank_reads_only_its_slices_of_its_layers(tmp_path: Path, monkeypatch, gguf: bool) -> None:
    path = _save(Case("llama-9-3", "llama", 9, 3, tie=False, bias=not gguf, gguf=gguf), tmp_path)
    whole = dict(_load(path).named_parameters())
    _as_rank(monkeypatch, 1, 2, 1, 2)   # heads 6..8, KV head 2, intermediate 50..99, vocab 501..1000, layers 2..
    model = build_model(_model_config(path), torch.device("cpu"))
    reader = RecordingReader(weight_reader(resolve_model(path)))
    model.load_weights(reader)
    read = {name.removeprefix("model."): (dim, start, size) for name, dim, start, size in reader.reads}
    assert not any(name.startswith(("layers.0.", "layers.1.", "embed_tokens.")) for name in read)
    assert read["layers.2.self_attn.q_proj.weight"] == (0, 6 * 16, 3 * 16)
    assert read["layers.2.self_attn.k_proj.weight"] == (0, 2 * 16, 16)
    assert read["layers.2.self_attn.o_proj.weight"] == (1, 6 * 16, 3 * 16)
    assert read["layers.2.mlp.up_proj.weight"] == (0, 50, 50)
    assert read["layers.2.mlp.down_proj.weight"] == (1, 50, 50)
    assert read["lm_head.weight"] == (0, 501, 500)
    assert read["layers.2.input_layernorm.weight"] == (None, 0, None)
    mine = dict(model.named_parameters())
    qkv = whole["layers.2.qkv_proj.weight"]
    torch.testing.assert_close(mine["layers.0.qkv_proj.weight"],
                               torch.cat([qkv[96:144], qkv[144 + 32:144 + 48], qkv[192 + 32:192 + 48]]), rtol=0, atol=0)
    torch.testing.assert_close(mine["layers.0.down_proj.weight"], whole["layers.2.down_proj.weight"][:, 50:],
                               rtol=0, atol=0)
    torch.testing.assert_close(mine["lm_head.weight"], whole["lm_head.weight"][501:], rtol=0, atol=0)
    if not gguf:
        bias = whole["layers.2.qkv_proj.bias"]
        torch.testing.assert_close(mine["layers.0.qkv_proj.bias"],
                                   torch.cat([bias[96:144], bias[176:192], bias[224:240]]), rtol=0, atol=0)


def test_safetensors_slices_equal_slices_of_the_whole_tensor(tmp_path: Path) -> None:
    path = _save(Case("llama-6-2", "llama", 6, 2, tie=False), tmp_path)
    reader = weight_reader(resolve_model(path))
    full = reader.read("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(reader.read("model.layers.1.mlp.down_proj.weight", 1, 30, 40), full[:, 30:70])
    assert torch.equal(reader.read("model.layers.1.mlp.down_proj.weight", 0, 5), full[5:])
    assert torch.equal(reader.read("model.norm.weight", 0, 3, 4), reader.read("model.norm.weight")[3:7])
    with pytest.raises(ValueError, match="outside"):
        reader.read("model.norm.weight", 0, 140, 10)


@pytest.fixture(scope="module")
def default_gguf():
    return weight_reader(resolve_model(str(default_model_path())))


def _quantized(reader, name: str) -> bool:
    return reader._infos[name].qtype.name not in ("F32", "F16")


@pytest.mark.parametrize("name", ["model.layers.3.mlp.down_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                                  "model.layers.3.mlp.gate_proj.weight", "model.embed_tokens.weight"])
def test_default_gguf_row_and_column_slices_equal_the_whole(default_gguf, name: str) -> None:
    assert _quantized(default_gguf, name)
    full = default_gguf.read(name)
    rows, cols = full.shape
    assert torch.equal(default_gguf.read(name, 0, rows // 3, rows // 3), full[rows // 3:2 * (rows // 3)])
    for start, size in ((cols // 2, cols // 2), (256, 256), (192, 384), (7, 100)):   # aligned, and not
        assert torch.equal(default_gguf.read(name, 1, start, size), full[:, start:start + size]), (start, size)


def test_default_gguf_q_and_k_rows_are_whole_heads_in_hf_layout(default_gguf) -> None:
    q = default_gguf.read("model.layers.5.self_attn.q_proj.weight")   # 9 heads of 64 rows
    assert torch.equal(default_gguf.read("model.layers.5.self_attn.q_proj.weight", 0, 6 * 64, 3 * 64), q[384:])
    k = default_gguf.read("model.layers.5.self_attn.k_proj.weight")   # 3 KV heads
    assert torch.equal(default_gguf.read("model.layers.5.self_attn.k_proj.weight", 0, 64, 64), k[64:128])
    with pytest.raises(ValueError, match="not whole heads"):
        default_gguf.read("model.layers.5.self_attn.q_proj.weight", 0, 32, 64)
