"""The real models of issue 62's families, from their own GGUF files (tests/support/real_models.py):
greedy tokens in float32 against transformers on the same file dequantized, token for token, prompts
past Gemma 3's 512-token window included; and the configuration `kestrel serve <file>` runs (bf16, the
file's quantized blocks kept) answering sensibly."""

from __future__ import annotations

import gc

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.support.real_models import gemma3_270m, qwen25_coder_05b

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
# 791 tokens in Gemma 3's tokenizer: longer than its local layers' 512-token window.
LONG = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} apples." for i in range(60))


def _transformers_greedy(path, prompts_ids: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts_ids:
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False)
            out.append(tokens[0, len(ids):].tolist())
    del model
    gc.collect()
    return out


def _kestrel_greedy(llm: LLM, prompts_ids: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _float32_parity(path, prompts: list[str], engine_check) -> None:
    llm = LLM(str(path), dtype="float32", quantization="none", max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    ours = _kestrel_greedy(llm, ids)
    engine_check(llm)
    del llm
    gc.collect()
    assert ours == _transformers_greedy(path, ids)


def test_gemma3_270m_float32_matches_transformers(engine_check):
    path = gemma3_270m()
    _float32_parity(path, ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                           LONG + " Which box holds the most apples?"], engine_check)


def test_gemma3_270m_as_served_continues_sensibly(engine_check):
    llm = LLM(str(gemma3_270m()), max_model_len=4096)   # bf16, the file's blocks: `kestrel serve`'s defaults
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate(["The capital of France is Paris. The capital of Germany is",
                        LONG + "\nItem 60: the red box holds"], params, use_tqdm=False)
    assert "Berlin" in out[0].outputs[0].text
    assert "apples" in out[1].outputs[0].text
    engine_check(llm)


def test_qwen25_coder_float32_matches_transformers(engine_check):
    _float32_parity(qwen25_coder_05b(), ["def fibonacci(n):", "The capital of France is",
                                         "import numpy as np\n\n# compute the mean of"], engine_check)


def test_qwen25_coder_as_served_answers_a_chat_question(engine_check):
    llm = LLM(str(qwen25_coder_05b()), max_model_len=4096)
    out = llm.chat([{"role": "user", "content": "Write a Python function that returns the square of a number."}],
                   SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    text = out[0].outputs[0].text
    assert "def " in text and "return" in text, text
    engine_check(llm)


def test_gemma3_270m_holds_its_windows_kv_not_its_whole_length(engine_check):
    """One ~4k-token request on Gemma 3 270M (15 local layers with a 512-token window, 3 global; KV-cache
    groups of 3 layers): after its prompt, the global group holds a block per 16 tokens, each of the
    five local groups the 33 blocks of its window, not 250."""
    llm = LLM(str(gemma3_270m()), max_model_len=8192)
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    ids = tokenizer((LONG + " ") * 6)["input_ids"][:4000]
    assert len(ids) == 4000
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    kv = engine.engine_core.kv_cache_manager
    assert kv.windows == (None, 512, 512, 512, 512, 512)
    held = None
    while engine.has_unfinished_requests():
        engine.step()
        (request_id,) = kv.req_to_blocks or (None,)
        if request_id is not None and engine.engine_core.scheduler.requests[request_id].num_computed_tokens > 4000:
            held = [sum(1 for b in ids if b) for ids in kv.get_block_ids(request_id)]
    assert held is not None
    assert held[0] == 251 and held[1:] == [33] * 5, held
    engine_check(llm)
