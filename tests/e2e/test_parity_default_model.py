"""Greedy parity with transformers on the real default model (SmolLM2-135M-Instruct, float32,
dense weights dequantized from the shipped Q4_1 GGUF; the default-configuration test runs its blocks as kept).

Token-exactness is not guaranteed: our attention sums in a different order from transformers', and
on this model one in a handful of 32-token continuations meets a near-tie. So the rule is vLLM's
(DESIGN.md): identical tokens up to the first difference, the chosen token's logprob within 2e-3
of transformers' at every step before it, and at the difference each side's token in the other's
top-5. Each test also asserts that most sequences match exactly. With --async-scheduling the tokens
are the same as without, token for token.
"""

import pytest
import torch

from kestrel import LLM
from kestrel.model.loader import iter_weights, load_config, resolve_model
from tests.support.parity import assert_greedy_close, hf_greedy, kestrel_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "Hi",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived a",
    "Translate to French: 'The weather is nice today.'\nFrench:",
    "List of the planets of the solar system, in order from the sun: Mercury, Venus,",
    ("The history of the printing press begins with movable type in East Asia. " * 12) + "In Europe,",
    ("Question: what is 17 times 3? Think step by step. " * 30) + "Answer:",
]
KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20)


def transformers_default_model(dtype: torch.dtype):
    """transformers' Llama on the file's weights dequantized (then rounded to `dtype`), as its GGUF
    load gives them. Read by Kestrel's GGUF reader, which test_loader checks against transformers'
    own GGUF load (tiny files) and gguf's decoding (this file): transformers' GGUF path took ~17 s a
    load here, most of it building the vocabulary's fields."""
    from transformers import LlamaForCausalLM
    src = resolve_model(None)
    model = LlamaForCausalLM(load_config(src)).eval()
    missing, unexpected = model.load_state_dict(dict(iter_weights(src)), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected   # the head is tied to the embedding
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.to(dtype)


@pytest.fixture(scope="module")
def hf_model():
    return transformers_default_model(torch.float32)


@pytest.fixture(scope="module")
def llm():
    return LLM(**KW)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    chat = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids.append(chat)
    lengths = sorted(len(p) for p in ids)
    assert lengths[0] < 5 and lengths[-1] > 300, lengths  # short to long prompts
    return ids


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return hf_greedy(hf_model, prompts, NEW_TOKENS)


def test_default_model_answers_the_design_doc_question(llm):
    from kestrel import SamplingParams
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>


def test_one_by_one(llm, prompts, reference, engine_check):
    ours = [kestrel_greedy(llm, [p], NEW_TOKENS)[0] for p in prompts]
    assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 2
    engine_check(llm)


def test_one_batch(llm, prompts, reference, engine_check):
    ours = kestrel_greedy(llm, prompts, NEW_TOKENS)
    assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 2
    engine_check(llm)


def test_chunked_prefill(prompts, reference, engine_check):
    llm = LLM(**KW, max_num_batched_tokens=48)
    assert max(len(p) for p in prompts) > 48  # long prompts must be split over steps
    ours = kestrel_greedy(llm, prompts, NEW_TOKENS)
    assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 2
    engine_check(llm)


def test_preemption(prompts, reference, engine_check):
    # 17 blocks of 16 tokens (one is the null block) hold one 256-token sequence, the least the
    # engine accepts for max_model_len=256; the short prompts fit at first, then outgrow the pool.
    keep = [i for i, p in enumerate(prompts) if len(p) + NEW_TOKENS <= 256]
    assert len(keep) == len(prompts) - 1
    llm = LLM(dtype="float32", max_model_len=256, num_kv_blocks=17, enable_prefix_caching=False)
    ours = kestrel_greedy(llm, [prompts[i] for i in keep], NEW_TOKENS)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert assert_greedy_close([reference[i] for i in keep], ours, exact=False) >= len(keep) - 2
    engine_check(llm)


def test_async_scheduling_gives_the_same_tokens(llm, prompts, reference, engine_check):
    """One batch, then chunked prefill with preemption: the same tokens as the synchronous engine's."""
    want = kestrel_greedy(llm, prompts, NEW_TOKENS)
    overlapped = LLM(**KW, async_scheduling=True)
    got = kestrel_greedy(overlapped, prompts, NEW_TOKENS)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert assert_greedy_close(reference, got, exact=False) >= len(prompts) - 2
    engine_check(overlapped)
    keep = [p for p in prompts if len(p) + NEW_TOKENS <= 256]
    tight = dict(dtype="float32", max_model_len=256, num_kv_blocks=17, enable_prefix_caching=False,
                 max_num_batched_tokens=48)
    sync_tight = kestrel_greedy(LLM(**tight), keep, NEW_TOKENS)
    overlapped = LLM(**tight, async_scheduling=True)
    assert [g.token_ids for g in kestrel_greedy(overlapped, keep, NEW_TOKENS)] == [w.token_ids for w in sync_tight]
    assert overlapped.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    engine_check(overlapped)


def test_prefix_cache_hits(llm, hf_model, engine_check):
    from kestrel import SamplingParams
    tok = llm.get_tokenizer()
    prefix = tok.encode("You are a helpful assistant. Here is a long shared context about birds. " * 10)
    prompts = [prefix + tok.encode(s) for s in [" Tell me about owls.", " Why do geese migrate?",
                                                 " Which bird is the fastest?", " Do penguins fly?"]]
    assert len(prefix) > 100
    reference = hf_greedy(hf_model, prompts, NEW_TOKENS)
    kestrel_greedy(llm, prompts[:1], NEW_TOKENS)  # fills the cache with the prefix
    ours = kestrel_greedy(llm, prompts[1:], NEW_TOKENS)
    assert assert_greedy_close(reference[1:], ours, exact=False) >= len(ours) - 1
    # Each later prompt found the prefix's full blocks in the cache.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                        SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    full_prefix_blocks = len(prefix) // 16 * 16
    assert all(o.num_cached_tokens >= full_prefix_blocks for o in outs), [o.num_cached_tokens for o in outs]
    engine_check(llm)


def test_default_configuration_against_transformers_bf16_and_float32(prompts, reference):
    """The configuration `kestrel serve` runs (no dtype: bf16 activations and KV cache where the CPU has
    bf16 kernels, the file's Q4_1 and Q8_0 blocks kept, float32 logits), all prompts in one batch, 32
    tokens each, against transformers in bf16 (its weights dequantized and rounded to bf16) by the
    top-5 rule, and against transformers in float32 (`reference`): it must match the float32 run
    exactly on at least as many prompts as transformers' own bf16 does, i.e. lose no more to rounding
    than bf16 weights alone explain. Measured on Zen 4 (2026-12-07): 8 of 9 prompts exact against
    float32, 4 against transformers bf16, which itself matches float32 on 4. (Before the logits were
    float32, its first answer to the README's question tied 'L' with 'The' and said "L'Étoile".)"""
    hf_bf16 = hf_greedy(transformers_default_model(torch.bfloat16), prompts, NEW_TOKENS)
    llm = LLM(max_model_len=1024, kv_cache_memory=256 << 20)
    ours = kestrel_greedy(llm, prompts, NEW_TOKENS)
    assert_greedy_close(hf_bf16, ours, exact=False, logprob_atol=BF16_LOGPROB_ATOL)
    ours_exact = sum(o.token_ids == r.token_ids for o, r in zip(ours, reference))
    bf16_exact = sum(h.token_ids == r.token_ids for h, r in zip(hf_bf16, reference))
    print(f"exact 32-token matches with transformers float32: kestrel default {ours_exact}/{len(prompts)}, "
          f"transformers bf16 {bf16_exact}/{len(prompts)}")
    assert ours_exact >= bf16_exact, (ours_exact, bf16_exact)


BF16_LOGPROB_ATOL = 0.5


def test_tensor_parallel_3(prompts, reference):
    """9 heads and 3 KV heads over three worker processes (one KV head each), weights read sharded
    from the GGUF, chunked prefill; the CPU's two cores are shared between the three ranks."""
    from kestrel import SamplingParams
    llm = LLM(**KW, tensor_parallel_size=3, max_num_batched_tokens=256)
    try:
        assert llm.llm_engine.engine_core.executor.collective_rpc(
            shard_heads) == [(3, 1), (3, 1), (3, 1)]
        ours = kestrel_greedy(llm, prompts, NEW_TOKENS)
        assert assert_greedy_close(reference, ours, exact=False) >= len(prompts) - 2
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
        assert out.text == "The capital of France is Paris."
    finally:
        llm.llm_engine.engine_core.shutdown()


def shard_heads(worker) -> tuple[int, int]:
    """(q heads, KV heads) of a worker's shard (a module-level function: it is pickled to the worker)."""
    return worker.shard.num_heads, worker.shard.num_kv_heads
