"""kestrel.bench.w6_model (W6's random-weight model) on a tiny shape, and `--workload W6`'s options.

The llama-quantize and llama-server checks need llama.cpp built (shared/bench/peers/llama_server.sh);
they are skipped where it is not."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel.bench.peers import built_llama_tool
from kestrel.bench.w6_model import (
    NORM_STD,
    TINYLLAMA_SHAPE,
    WEIGHT_STD,
    LlamaShape,
    W6Model,
    permute_rotary,
    quantized_gguf,
    recipe_key,
    w6_model,
)
from kestrel.model.gguf_loader import GGUFWeightReader, gguf_config, read_gguf_header, unpermute_rotary
from kestrel.model.hf_loader import SafetensorsReader, hf_config
from kestrel.model.loader import load_tokenizer, resolve_model

# Rows a multiple of 256, so that llama-quantize's K-quants apply as they do at full size.
TINY = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=2000, max_position_embeddings=512)
TEXT = "The quick brown fox jumps over the lazy dog. Café, naïve; 12345 + 678 = 13023!\n\tdef f(x): return x"
LLAMA_QUANTIZE = built_llama_tool("llama-quantize")
LLAMA_SERVER = built_llama_tool("llama-server")
needs_quantize = pytest.mark.skipif(LLAMA_QUANTIZE is None, reason="needs llama.cpp's llama-quantize")
needs_server = pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> W6Model:
    return w6_model(TINY, cache_dir=tmp_path_factory.mktemp("kestrel-cache"))


def _llm(model: Path, dtype: str = "float32"):
    from kestrel import LLM
    return LLM(model=str(model), dtype=dtype, max_model_len=128, kv_cache_memory=16 << 20,
               max_num_batched_tokens=128, max_num_seqs=4)


# ---- the recipe and the cache entry --------------------------------------------------------------

def test_recipe_key_follows_the_shape():
    assert recipe_key(TINY) == recipe_key(LlamaShape(**{**TINY.__dict__}))
    keys = {recipe_key(s) for s in (TINY, TINYLLAMA_SHAPE, LlamaShape(**{**TINY.__dict__, "vocab_size": 3000}),
                                    LlamaShape(**{**TINY.__dict__, "num_hidden_layers": 3}),
                                    LlamaShape(**{**TINY.__dict__, "rope_theta": 5e5}))}
    assert len(keys) == 5


def test_entry_is_written_once_and_reused(tiny):
    assert tiny.folder.name == f"{TINY.tag}-{recipe_key(TINY)}"
    before = {p: p.stat().st_mtime_ns for p in tiny.folder.rglob("*")}
    assert w6_model(TINY, cache_dir=tiny.folder.parent.parent) == tiny
    assert {p: p.stat().st_mtime_ns for p in tiny.folder.rglob("*")} == before
    assert [p.name for p in tiny.folder.parent.iterdir()] == [tiny.folder.name]  # no temp folder left


def test_configs_give_the_shape(tiny):
    from_folder = hf_config(str(tiny.hf_folder))
    from_gguf = gguf_config(read_gguf_header(tiny.bf16_gguf))
    for config in (from_folder, from_gguf):
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                config.intermediate_size, config.vocab_size, config.max_position_embeddings) == \
               (256, 2, 4, 2, 512, 2000, 512)
        assert config.rms_norm_eps == pytest.approx(1e-5) and config.rope_parameters["rope_theta"] == 10000.0
        assert not config.tie_word_embeddings
        assert (config.bos_token_id, config.eos_token_id) == (from_folder.bos_token_id, from_folder.eos_token_id)


def test_tinyllama_shape_counts_1_1b_parameters():
    from kestrel.bench.roofline import model_param_counts
    counts = model_param_counts(type("Config", (), {**TINYLLAMA_SHAPE.__dict__, "head_dim": 64,
                                                    "model_type": "llama"})())
    total = counts.non_embedding + counts.output_head + TINYLLAMA_SHAPE.vocab_size * TINYLLAMA_SHAPE.hidden_size
    assert total == 1_100_048_384  # TinyLlama-1.1B's parameter count


# ---- weights -------------------------------------------------------------------------------------

def test_permute_rotary_is_what_the_loader_undoes():
    w = torch.randn(4 * 64, 32)
    permuted = permute_rotary(w, 4)
    assert not torch.equal(permuted, w)
    assert torch.equal(torch.from_numpy(unpermute_rotary(permuted.numpy(), 4)), w)


def test_folder_and_bf16_gguf_hold_bit_identical_weights(tiny):
    folder, gguf = SafetensorsReader(str(tiny.hf_folder)), GGUFWeightReader(str(tiny.bf16_gguf))
    assert sorted(folder.names()) == sorted(gguf.names())
    assert len(folder.names()) == 2 * 9 + 3
    for name in folder.names():
        stored = folder.read(name)
        assert stored.dtype == torch.bfloat16, name
        assert torch.equal(stored.float(), gguf.read(name)), name
    embed, head = folder.read("model.embed_tokens.weight").float(), folder.read("lm_head.weight").float()
    assert embed.shape == head.shape == (2000, 256) and not torch.equal(embed, head)  # untied
    assert embed.std().item() == pytest.approx(WEIGHT_STD, rel=0.02) and abs(embed.mean().item()) < 1e-3
    norm = folder.read("model.layers.0.input_layernorm.weight").float()
    assert norm.mean().item() == pytest.approx(1.0, abs=0.01) and norm.std().item() == pytest.approx(NORM_STD, rel=0.3)


@pytest.mark.timeout(600)
def test_folder_gguf_and_transformers_greedy_tokens_agree(tiny):
    from transformers import AutoModelForCausalLM

    from tests.support.parity import assert_greedy_close, hf_greedy, kestrel_greedy

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 2000, size=n).tolist() for n in (5, 17, 40)]
    reference = hf_greedy(AutoModelForCausalLM.from_pretrained(tiny.hf_folder, dtype=torch.float32).eval(),
                          prompts, 12)
    for model in (tiny.hf_folder, tiny.bf16_gguf):
        llm = _llm(model)
        ours = kestrel_greedy(llm, prompts, 12)
        llm.llm_engine.shutdown()
        assert assert_greedy_close(reference, ours, exact=True) == len(prompts), model


# ---- tokenizer -----------------------------------------------------------------------------------

def test_tokenizers_agree_and_round_trip(tiny):
    from transformers import AutoTokenizer

    tokenizers = {"kestrel folder": load_tokenizer(resolve_model(str(tiny.hf_folder))),
                  "kestrel gguf": load_tokenizer(resolve_model(str(tiny.bf16_gguf))),
                  "transformers folder": AutoTokenizer.from_pretrained(tiny.hf_folder, local_files_only=True)}
    ids = {name: t.encode(TEXT, add_special_tokens=False) for name, t in tokenizers.items()}
    assert len(set(map(tuple, ids.values()))) == 1, ids
    [token_ids] = {tuple(v) for v in ids.values()}
    assert max(token_ids) < TINY.vocab_size and len(token_ids) < len(TEXT)  # merges do apply
    for name, t in tokenizers.items():
        assert len(t) == TINY.vocab_size, name
        assert t.decode(list(token_ids)) == TEXT, name


@needs_server
@pytest.mark.timeout(300)
def test_llama_server_tokenizes_and_generates_like_kestrel(tiny):
    """llama.cpp reads the bf16 GGUF as Kestrel does: the same tokens for a text, and the same greedy
    tokens with top-5 logprobs within float rounding (llama.cpp computes in bf16/f32, Kestrel here in f32)."""
    from kestrel.bench.peers import LlamaServer
    from tests.support.parity import kestrel_greedy

    expected_ids = load_tokenizer(resolve_model(str(tiny.bf16_gguf))).encode(TEXT, add_special_tokens=False)
    prompt = list(range(100, 160))
    llm = _llm(tiny.bf16_gguf)
    [ours] = kestrel_greedy(llm, [prompt], 8)
    llm.llm_engine.shutdown()
    with LlamaServer(tiny.bf16_gguf, parallel=1, ctx_per_slot=256, threads=1, binary=LLAMA_SERVER) as server:
        assert _post(f"{server.url}/tokenize", {"content": TEXT})["tokens"] == expected_ids
        theirs = _post(f"{server.url}/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0,
                                                    "return_tokens": True, "n_probs": 5, "cache_prompt": False})
    assert theirs["tokens"] == ours.token_ids
    for step, probs in zip(ours.top, theirs["completion_probabilities"], strict=True):
        top = {p["id"]: p["logprob"] for p in probs["top_logprobs"]}
        assert top.keys() == step.keys()
        assert all(abs(top[t] - lp) < 5e-3 for t, lp in step.items()), (top, step)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


# ---- llama-quantize's files ----------------------------------------------------------------------

@needs_quantize
def test_quantized_files_load_close_to_the_bf16_weights(tiny):
    bf16 = GGUFWeightReader(str(tiny.bf16_gguf))
    q8 = GGUFWeightReader(str(quantized_gguf(tiny, "Q8_0", binary=LLAMA_QUANTIZE)))
    q4 = GGUFWeightReader(str(quantized_gguf(tiny, "Q4_K_M", binary=LLAMA_QUANTIZE)))
    assert read_gguf_header(tiny.quantized_path("Q4_K_M")).tensors["blk.0.ffn_up.weight"].qtype.name == "Q4_K"
    for name in bf16.names():
        exact = bf16.read(name)
        if exact.dim() == 1:  # norms stay f32
            assert torch.equal(q8.read(name), exact) and torch.equal(q4.read(name), exact), name
            continue
        # Q8_0: blocks of 32 along a row, scale max|x| / 127 in f16: off by half a step and the
        # scale's rounding over up to 127 steps.
        blocks = exact.reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127
        assert torch.all((q8.read(name).reshape(-1, 32) - blocks).abs() <= step * (0.5 + 127 * 2.0 ** -11) + 1e-9), name
        # Q4_K (Q6_K for some tensors): 4 bits with a scale and minimum per 32 values.
        relative_rms = ((q4.read(name) - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
        assert 0 < relative_rms < 0.15, (name, relative_rms)


@needs_quantize
@pytest.mark.timeout(600)
def test_quantized_files_generate_in_kestrel(tiny):
    from kestrel.model.quantization import GGUFLinear
    from kestrel.ops import cpu_kernels
    from tests.support.parity import kestrel_greedy, worker_of

    prompts = [list(range(100, 130))]
    llm = _llm(tiny.bf16_gguf)
    [reference] = kestrel_greedy(llm, prompts, 8)
    llm.llm_engine.shutdown()
    for quant_type in ("Q8_0", "Q4_K_M", "Q5_K_M"):
        # In bf16 where the kernels run: the file's blocks kept, as `kestrel serve` runs them.
        llm = _llm(quantized_gguf(tiny, quant_type, binary=LLAMA_QUANTIZE), "bfloat16" if cpu_kernels() else "float32")
        kept = {fmt.name for module in worker_of(llm).model.modules() if isinstance(module, GGUFLinear)
                for fmt, _ in module.parts}
        assert not cpu_kernels() or {"Q8_0": {"Q8_0"}, "Q4_K_M": {"Q4_K", "Q6_K"},
                                     "Q5_K_M": {"Q5_K", "Q6_K"}}[quant_type] <= kept, (quant_type, kept)
        [ours] = kestrel_greedy(llm, prompts, 8)
        llm.llm_engine.shutdown()
        assert all(0 <= t < TINY.vocab_size for t in ours.token_ids)
        assert all(np.isfinite(lp) for step in ours.top for lp in step.values())
        # The weights differ by the quantization's error only: the bf16 file's first token is among its top 5.
        assert reference.token_ids[0] in ours.top[0], quant_type


def test_unknown_quantization_is_refused(tiny):
    with pytest.raises(ValueError, match="unknown quantization"):
        quantized_gguf(tiny, "Q2_K", binary=Path("/nonexistent"))


# ---- `kestrel bench throughput --workload W6` ----------------------------------------------------

def _throughput_args(*argv: str):
    from kestrel.entrypoints.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["bench", "throughput", *argv])
    return args, engine_kwargs(args)


def test_w6_options_are_checked():
    from kestrel.bench.throughput import check_options

    args, kwargs = _throughput_args("--workload", "W6", "--peer", "llama-server:bf16", "--peer", "llama-server:q8_0",
                                    "--peer", "llama-server:q4_k", "--peer", "llama-server:q5_k", "--peer",
                                    "transformers")
    check_options(args, kwargs)
    args, kwargs = _throughput_args("--workload", "W6", "--model", "x.gguf")
    with pytest.raises(ValueError, match="drop --model"):
        check_options(args, kwargs)
    for peer in ("llama-server:q4_1", "llama-server:f32"):
        args, kwargs = _throughput_args("--workload", "W6", "--peer", peer)
        with pytest.raises(ValueError, match=f"got {peer}"):
            check_options(args, kwargs)
    for peer in ("llama-server:q4_k", "llama-server:q5_k"):
        args, kwargs = _throughput_args("--peer", peer)  # W1
        with pytest.raises(ValueError, match=f"{peer} reads .* --workload W6"):
            check_options(args, kwargs)
    args, kwargs = _throughput_args("--workload", "W6", "--kestrel-weights", "q8_0", "--peer", "llama-server:q8_0")
    check_options(args, kwargs)
    check_options(*_throughput_args("--workload", "W6", "--kestrel-weights", "q5_k_m", "--peer", "llama-server:q5_k"))
    args, kwargs = _throughput_args("--kestrel-weights", "q8_0")  # W1
    with pytest.raises(ValueError, match="--kestrel-weights .* --workload W6"):
        check_options(args, kwargs)
    check_options(*_throughput_args("--kestrel-weights", "native", "--peer", "llama-server"))  # W1 on its file
    args, kwargs = _throughput_args("--workload", "W6", "--kestrel-weights", "native")
    with pytest.raises(ValueError, match="W6's are q8_0, q4_k_m or q5_k_m"):
        check_options(args, kwargs)


def test_w6_requests_are_w1s_inside_the_vocabulary():
    from kestrel.bench.throughput import workload_requests
    from kestrel.bench.workloads import W6_TOKEN_ID_RANGE, w1_offline_throughput, warm_up_requests

    args, _ = _throughput_args("--workload", "W6")
    w6, w1 = workload_requests(args), w1_offline_throughput()
    assert [(r.input_len, r.output_len) for r in w6] == [(r.input_len, r.output_len) for r in w1]
    ids = [t for r in w6 for t in r.prompt_token_ids]
    assert min(ids) >= W6_TOKEN_ID_RANGE[0] and max(ids) == W6_TOKEN_ID_RANGE[1] < TINYLLAMA_SHAPE.vocab_size
    assert max(t for r in w1 for t in r.prompt_token_ids) >= TINYLLAMA_SHAPE.vocab_size  # why W6 draws its own
    # The engines' warm-up requests fit W6's vocabulary too.
    assert max(t for r in warm_up_requests() for t in r.prompt_token_ids) < TINYLLAMA_SHAPE.vocab_size


def test_w6_peers_read_the_generated_files(tmp_path):
    from kestrel.bench.launch import launch_server, repack_args
    from kestrel.bench.throughput import w6_kestrel_model, w6_peer_gguf

    model = W6Model(tmp_path, TINY)
    for quant_type in ("Q8_0", "Q4_K_M", "Q5_K_M"):
        model.quantized_path(quant_type).touch()  # made already: nothing is quantized here
    assert w6_peer_gguf("llama-server:bf16", model) == model.bf16_gguf
    assert w6_peer_gguf("llama-server:q8_0", model) == model.quantized_path("Q8_0")
    assert w6_peer_gguf("llama-server:q4_k", model) == model.quantized_path("Q4_K_M")
    assert w6_peer_gguf("llama-server:q5_k", model) == model.quantized_path("Q5_K_M")
    # Kestrel reads the folder, or with --kestrel-weights q8_0 (q4_k_m) the very file llama-server:q8_0 (:q4_k) reads.
    assert w6_kestrel_model("bf16", model) == model.hf_folder
    assert w6_kestrel_model("q8_0", model) == model.quantized_path("Q8_0")
    assert w6_kestrel_model("q4_k_m", model) == model.quantized_path("Q4_K_M")
    assert w6_kestrel_model("q5_k_m", model) == model.quantized_path("Q5_K_M")
    for peer in ("llama-server:q4_k", "llama-server:q5_k"):
        with pytest.raises(ValueError, match="--workload W6"):
            launch_server(peer, parallel=1, ctx_per_slot=64)
    # Q4_K keeps llama.cpp's AVX2 repacking except where AMX would trap; Q8_0 never repacks (as for W1).
    assert repack_args("q4_k", has_amx=False) == [] and repack_args("q4_k", has_amx=True) == ["--no-repack"]
    assert repack_args("q5_k", has_amx=False) == [] and repack_args("q5_k", has_amx=True) == ["--no-repack"]
    assert repack_args("q8_0", has_amx=False) == ["--no-repack"] and repack_args("bf16", has_amx=True) == []


def test_w6_report_names_the_workload_and_each_engines_file():
    from datetime import UTC, datetime

    from kestrel.bench.common import EngineResult
    from kestrel.bench.throughput import workload_requests
    from kestrel.bench.throughput_report import build_report, format_markdown, format_summary

    args, _ = _throughput_args("--workload", "W6", "--num-prompts", "4", "--runs", "1")
    requests = workload_requests(args)
    tokens = {"input_tokens": sum(r.input_len for r in requests), "output_tokens": sum(r.output_len for r in requests)}
    common = {**tokens, "generated_tokens": tokens["output_tokens"], "load_s": 1.0, "peak_rss_bytes": 1 << 30,
              "rss_after_load_bytes": 1 << 30, "torch_threads": 2}
    results = [EngineResult(name="kestrel", run_wall_s=[10.0], **common),
               EngineResult(name="llama-server:q4_k", run_wall_s=[12.0],
                            notes=["llama.cpp q4_k_m, read /c/m.Q4_K_M.gguf"], **common)]
    engine = {"model": "m", "model_path": "/c/m", "gguf_file": None, "format": "Hugging Face folder",
              "dtype": "bfloat16", "device": "cpu", "max_num_seqs": 256, "max_num_batched_tokens": 2048,
              "num_kv_blocks": 10, "block_size": 16, "enable_chunked_prefill": True}
    report = build_report(args, requests, results, engine, datetime.now(UTC), (0.0, 0.0, 0.0))
    assert report["workload"]["id"] == "W6 (reduced)" and report["workload"]["token_id_range"] == [100, 31999]
    markdown = format_markdown(report)
    assert "## W6 (reduced) offline throughput of a 1B-class model" in markdown
    assert "Kestrel read /c/m\n" in markdown and "prompt ids 100..31999" in markdown
    assert "read /c/m.Q4_K_M.gguf" in markdown and "read /c/m)" in format_summary(report)
