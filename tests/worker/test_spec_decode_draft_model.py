"""Speculative decoding with a draft model (issue 19): a smaller model with the target's vocabulary,
in the same worker, with its own KV cache in the target's blocks.

Greedy outputs token-identical with and without it (tiny random models and the default model; mixed
batches, chunked prefill, preemption, prefix-cache hits); a draft that is the target itself is
always accepted; with sampling, the tokens it verifies are distributed as the target's (chi-squared
over single tokens and pairs, with a draft that disagrees often); bad settings are refused."""

from __future__ import annotations

import random

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.sample.test_rejection_sampler import chi_squared_p
from tests.support.parity import save_tiny_llama, save_tiny_model

pytestmark = pytest.mark.slow

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft): two tiny random Llamas of the default model's vocabulary, of different sizes."""
    root = tmp_path_factory.mktemp("draft-model")
    save_tiny_llama(root / "target")
    save_tiny_llama(root / "draft", hidden_size=32, intermediate_size=64)
    return root / "target", root / "draft"


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(rng.randint(1, 70))]} for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("case", ["batched", "chunked-prefill", "preemption", "prefix-hits"])
def test_greedy_tokens_are_the_same_with_a_draft_model(models, case, engine_check):
    target, draft = models
    batch = prompts(8)
    extra = {"batched": {}, "chunked-prefill": dict(max_num_batched_tokens=16),
             "preemption": dict(num_kv_blocks=24, enable_prefix_caching=False), "prefix-hits": {}}[case]
    want = token_ids(LLM(str(target), **KW), batch, GREEDY)
    llm = LLM(str(target), **KW, **extra, speculative_config=draft_config(draft))
    if case == "prefix-hits":
        token_ids(llm, batch, GREEDY)  # the second run finds every prompt's full blocks in the cache
    assert token_ids(llm, batch, GREEDY) == want
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    if case == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    if case == "prefix-hits":
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert sum(o.num_cached_tokens for o in outs) > 0
    engine_check(llm)


def test_a_draft_that_is_the_target_is_always_accepted(models, engine_check):
    target, _ = models
    llm = LLM(str(target), **KW, speculative_config=draft_config(target, k=4))
    token_ids(llm, prompts(6), GREEDY)
    greedy = llm.llm_engine.spec_decoding_stats
    assert greedy.num_draft_tokens > 0 and greedy.num_accepted_tokens == greedy.num_draft_tokens
    # Sampled: q is p (up to float rounding), so min(1, p/q) accepts (almost) every draft.
    before = (greedy.num_draft_tokens, greedy.num_accepted_tokens)
    token_ids(llm, prompts(6, seed=1), SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True))
    stats = llm.llm_engine.spec_decoding_stats
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 50 and accepted >= 0.98 * drafted
    engine_check(llm)


def test_default_model_with_a_tiny_draft(models):
    """The default model (float32) drafted for by a tiny random model of its vocabulary: the same
    greedy tokens, and the chat answer."""
    _, draft = models
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory=128 << 20)  # the draft has 512 positions
    texts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village, there lived a"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = token_ids(LLM(**kw), texts, params)
    llm = LLM(**kw, speculative_config=draft_config(draft, k=2))
    assert token_ids(llm, texts, params) == want
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."


# ---- sampling: distributed as the target's -----------------------------------------------------------

SMALL_VOCAB = 16
PROMPT = [3, 9, 4, 12, 7]


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    """A target and a draft over 16 tokens (so that the distributions can be counted), whose
    distributions differ a lot: the draft is another random model."""
    from transformers import LlamaConfig
    root = tmp_path_factory.mktemp("small-vocab")

    def config(hidden: int, layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                           tie_word_embeddings=False)

    target = save_tiny_model(root / "target", config(64, 2))
    save_tiny_model(root / "draft", config(32, 1))
    return root / "target", root / "draft", target


def next_token_probs(model, sequences: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(sequences)).logits[:, -1].float().softmax(-1)


def test_verified_tokens_are_distributed_as_the_targets(small_vocab_models):
    """Four tokens per request at temperature 1, two drafts verified at once after the first: the
    distribution of the first verified token and of the verified pair is the target's (chi-squared),
    though the draft disagrees with it often."""
    target, draft, hf = small_vocab_models
    n = 4000
    llm = LLM(str(target), dtype="float32", max_model_len=64, kv_cache_memory=16 << 20, max_num_seqs=512,
              speculative_config=draft_config(draft, k=2))
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    outs = token_ids(llm, [{"prompt_token_ids": PROMPT}] * n, params)
    stats = llm.llm_engine.spec_decoding_stats
    acceptance = stats.num_accepted_tokens / stats.num_draft_tokens
    assert stats.num_drafts >= n and 0.15 < acceptance < 0.85, acceptance  # drafted, and often wrong

    # The target's own distribution of (t2, t3), summed over t1.
    v = SMALL_VOCAB
    p1 = next_token_probs(hf, [PROMPT])[0]
    p2 = next_token_probs(hf, [PROMPT + [a] for a in range(v)])                      # [t1, t2]
    p3 = next_token_probs(hf, [PROMPT + [a, b] for a in range(v) for b in range(v)]).view(v, v, v)
    pair = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)                            # [t2, t3]
    second = torch.bincount(torch.tensor([o[1] for o in outs]), minlength=v)
    assert chi_squared_p(second, pair.sum(1)) > 1e-3, (second, pair.sum(1) * n)
    pairs = torch.bincount(torch.tensor([o[1] * v + o[2] for o in outs]), minlength=v * v)
    expected = pair.flatten()
    rare = expected * n < 5  # pool the cells too rare for the chi-squared approximation
    pooled_counts = torch.cat([pairs[~rare], pairs[rare].sum().view(1)])
    pooled_probs = torch.cat([expected[~rare], expected[rare].sum().view(1)])
    assert chi_squared_p(pooled_counts, pooled_probs) > 1e-3


# ---- settings ----------------------------------------------------------------------------------------

def test_draft_model_settings_are_checked(models, small_vocab_models):
    from kestrel.engine.arg_utils import EngineArgs, create_engine_config
    target, draft = models
    with pytest.raises(ValueError, match="vocabulary .*16 tokens.* is not the target's .*49152"):
        create_engine_config(EngineArgs(model=str(target), max_model_len=64,
                                        speculative_config=draft_config(small_vocab_models[1])))
    with pytest.raises(ValueError, match="one worker"):
        create_engine_config(EngineArgs(model=str(target), tensor_parallel_size=2,
                                        speculative_config=draft_config(draft)))
    with pytest.raises(ValueError, match="draft model .*nowhere"):
        create_engine_config(EngineArgs(model=str(target), speculative_config=draft_config(target / "nowhere")))
    config, _, _ = create_engine_config(EngineArgs(model=str(target), speculative_config=draft_config(draft)))
    assert config.draft_model.hidden_size == 32 and config.scheduler.num_lookahead_tokens == 3
