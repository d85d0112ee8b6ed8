"""Greedy parity with transformers on tiny random-weight models of each family built here: Llama,
Qwen2, Qwen3, Granite, Phi-3 (and Phi-4's partial rotary and LongRoPE), Mistral (sliding window),
Gemma 2 (soft caps) and Gemma 3 (local and global layers); in float32, alone and batched, with chunked
prefill, preemption and prefix-cache hits; and the same tokens with --async-scheduling as without. The
windowed models' windows (24 tokens) are far shorter than the longer prompts, and their head_dim (64)
is one the decode kernel takes, so that its window is what runs.

Random weights give flat distributions where float-order noise can swap near-tied tokens, so the
rule is DESIGN.md's top-5 rule plus a logprob tolerance before the first difference; each test
also asserts that most sequences match exactly.
"""

import random

import pytest
import torch

from kestrel import LLM
from tests.support.parity import assert_greedy_close, hf_greedy, kestrel_greedy

NEW_TOKENS = 24
VOCAB = 49152  # the default model's tokenizer is reused, so the vocabulary matches it


WINDOW = 24


def _tiny_config(kind: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if kind == "llama3-rope":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
    if kind == "qwen2":   # q, k and v with biases, o without
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if kind == "granite":   # its four multipliers, as Granite 3's are set
        return GraniteConfig(**common, tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                             attention_multiplier=0.0625, logits_scaling=0.5)
    if kind == "phi3":   # q|k|v and gate|up fused in the checkpoint
        return Phi3Config(**dict(common, hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
                          tie_word_embeddings=False, pad_token_id=0)
    if kind == "phi4-longrope":   # Phi-4-mini's partial rotary and LongRoPE (its short factors: see layers.py)
        return Phi3Config(**dict(common, hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
                          tie_word_embeddings=True, pad_token_id=0, original_max_position_embeddings=200,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + i / 24 for i in range(24)],
                                           "long_factor": [2.0 + i / 6 for i in range(24)],
                                           "original_max_position_embeddings": 200})
    windowed = dict(common, num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=WINDOW)
    if kind == "mistral":
        return MistralConfig(**windowed, tie_word_embeddings=True)
    if kind == "gemma2":   # local, global; soft caps low enough to change scores and logits
        return Gemma2Config(**windowed, query_pre_attn_scalar=48, pad_token_id=0, attn_logit_softcapping=0.3,
                            final_logit_softcapping=4.0)
    if kind == "gemma3":   # local, global, local; an attention scale other than head_dim's
        return Gemma3TextConfig(**dict(windowed, num_hidden_layers=3), query_pre_attn_scalar=48, pad_token_id=0,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(kind)


@pytest.fixture(scope="module")
def tokenizer():
    from kestrel.model.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(None))


def _build(kind: str, folder, tokenizer):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(kind), dtype=torch.float32).eval()
    # Larger-than-default weights make the distributions peaked enough for greedy to be stable.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):   # zeros by default: a bias misplaced would not show
                p.normal_(0, 0.5)
            elif kind.startswith("gemma") and "norm" in name:   # Gemma's (1 + w) norms start at w = 0
                p.normal_(0, 0.3)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 16, 17, 40, 77, 150][:n]
    return [[rng.randrange(100, VOCAB) for _ in range(L)] for L in lengths]


KINDS = ["llama", "llama3-rope", "qwen2", "qwen3", "granite", "phi3", "phi4-longrope", "mistral", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, folder, tokenizer)
    prompts = _prompts(8)
    return folder, prompts, hf_greedy(model, prompts, NEW_TOKENS), model


KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(params=["compiled-kernels", "pytorch-path"])
def kernel_mode(request, monkeypatch):
    """Run the engine with the compiled CPU kernels (when this machine builds them) and with the
    pure-PyTorch reference path."""
    from kestrel.ops import cpu_kernels
    if request.param == "pytorch-path":
        monkeypatch.setenv("KESTREL_DISABLE_CPU_KERNELS", "1")
    cpu_kernels.cache_clear()
    yield request.param
    cpu_kernels.cache_clear()


def test_alone_and_batched(tiny, kernel_mode, engine_check):
    folder, prompts, reference, _ = tiny
    llm = LLM(str(folder), **KW)
    alone = [kestrel_greedy(llm, [p], NEW_TOKENS)[0] for p in prompts]
    assert assert_greedy_close(reference, alone, exact=False) >= len(prompts) - 2
    batched = kestrel_greedy(llm, prompts, NEW_TOKENS)
    assert assert_greedy_close(reference, batched, exact=False) >= len(prompts) - 2
    engine_check(llm)


def _tight_pool(folder) -> int:
    """Blocks that barely hold one 256-token sequence prefilled in chunks of 20: 17 blocks of 16 for a
    model of one KV-cache group; with sliding-window groups, their windows' blocks added."""
    from transformers import AutoConfig

    from kestrel.model import model_config_from_hf
    cfg = model_config_from_hf(AutoConfig.from_pretrained(folder), model=None, dtype=torch.float32,
                               max_model_len=256, eos_token_id=2, bos_token_id=1)
    return cfg.kv_groups.max_blocks_held(256, 16, 20) + 1


def test_chunked_prefill_and_preemption(tiny, kernel_mode, engine_check):
    folder, prompts, reference, _ = tiny
    # A 20-token budget splits every long prompt; the pool barely holds one 256-token sequence.
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=20,
              num_kv_blocks=_tight_pool(folder), enable_prefix_caching=False)
    ours = kestrel_greedy(llm, prompts, NEW_TOKENS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 2
    engine_check(llm)


def test_prefix_cache_hits(tiny, engine_check):
    folder, _, _, model = tiny
    rng = random.Random(1)
    prefix = [rng.randrange(100, VOCAB) for _ in range(70)]
    prompts = [prefix + [rng.randrange(100, VOCAB) for _ in range(k)] for k in (1, 5, 12)]
    reference = hf_greedy(model, prompts, NEW_TOKENS)
    llm = LLM(str(folder), **KW)
    first = kestrel_greedy(llm, prompts[:1], NEW_TOKENS)
    before = llm.llm_engine.engine_core.kv_cache_manager
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                        __import__("kestrel").SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                             ignore_eos=True, logprobs=5), use_tqdm=False)
    assert all(o.num_cached_tokens == 64 for o in rest), [o.num_cached_tokens for o in rest]
    from tests.support.parity import Greedy
    ours = first + [Greedy(o.outputs[0].token_ids,
                           [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs]) for o in rest]
    assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 1
    assert before.pool.cached_blocks  # full blocks stay hashed after their requests ended
    engine_check(llm)


def test_async_scheduling_gives_the_same_tokens(tiny, engine_check):
    """Each step planned while the one before runs: token-identical to the synchronous engine, batched,
    with chunked prefill and preemption, and with prefix-cache hits."""
    folder, prompts, reference, _ = tiny
    tight = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=20, num_kv_blocks=_tight_pool(folder),
                 enable_prefix_caching=False)
    for kw in (KW, tight):
        runs = {}
        for overlapped in (False, True):
            llm = LLM(str(folder), **kw, async_scheduling=overlapped)
            runs[overlapped] = kestrel_greedy(llm, prompts, NEW_TOKENS)
            if kw is tight:
                assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
            engine_check(llm)
        assert [g.token_ids for g in runs[True]] == [g.token_ids for g in runs[False]]
        assert assert_greedy_close(reference, runs[True], exact=False) >= len(prompts) - 2
    llm = LLM(str(folder), **KW, async_scheduling=True)
    kestrel_greedy(llm, prompts[-1:], NEW_TOKENS)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[-1:] * 2],
                         __import__("kestrel").SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [runs[False][-1].token_ids] * 2
    assert all(o.num_cached_tokens >= 144 for o in again), [o.num_cached_tokens for o in again]
    engine_check(llm)


@pytest.mark.parametrize("kind, setting, off", [("mistral", "sliding_window", 10 ** 6),
                                               ("gemma2", "sliding_window", 10 ** 6),
                                               ("gemma3", "sliding_window", 10 ** 6),
                                               ("gemma2", "attn_logit_softcapping", None),
                                               ("gemma2", "final_logit_softcapping", None)])
def test_the_window_and_the_caps_decide_tokens(kind, setting, off, tmp_path, tokenizer):
    """The references differ from the same weights without the window (or a soft cap) on the prompts
    longer than the window: the parity above checks them, not only the rest of the model."""
    model = _build(kind, tmp_path, tokenizer)
    prompts = _prompts(8)[5:]   # 40, 77 and 150 tokens
    with_it = hf_greedy(model, prompts, NEW_TOKENS)
    for holder in (model.config, *model.modules()):   # the attention layers keep their own copy of the cap
        if hasattr(holder, setting) and not isinstance(getattr(holder, setting), torch.nn.Module):
            setattr(holder, setting, off)
    without = hf_greedy(model, prompts, NEW_TOKENS)
    # (the logits' cap is monotonic: it changes the logprobs, not the greedy tokens)
    assert any(list(a.token_ids) != list(b.token_ids)
               or abs(a.top[0][a.token_ids[0]] - b.top[0][b.token_ids[0]]) > 0.01
               for a, b in zip(with_it, without))
