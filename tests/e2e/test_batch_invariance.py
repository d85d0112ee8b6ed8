"""Batch and prefix invariance in the configuration `make serve` runs: no --dtype (bf16 activations and
KV cache on a CPU with bf16 kernels), the default model's Q4_1 layers and Q8_0 head kept as the file
stores them, float32 logits. A greedy request's tokens and logprobs are the same bits alone, again
after its prefix is cached, in a batch of 32 mixed requests, and with a 64-token step budget (its
prompt in chunks): every row's sums run in an order fixed by the row alone (linear_gguf at every row
count, the decode attention's segments fixed by the sequence's length, a prompt's rows always on the
prefill kernel), so nothing a neighbour does can move a bit.

The same holds for dense bf16 layers (`--quantization none`, a bf16 Hugging Face folder), packed after
loading. What is not held invariant yet (docs/batch_invariance.md): the AMX matmul, Q4_K and Q6_K blocks,
float32 models beyond linear_f32's 128 rows, and a preempted request's recomputed generated tokens (the
prefill kernel, where they were decoded).
"""

import concurrent.futures

import httpx2 as httpx
import pytest

from kestrel import LLM, SamplingParams
from kestrel.ops.dispatch import amx_gemv
from tests.support.server_process import Server, chat_capital_of_france

pytestmark = pytest.mark.slow

QUESTIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three primary colors."}],
    # 385 tokens: 24 whole blocks, so a second run meets a one-token prompt chunk after the cached prefix
    [{"role": "user", "content": "Summarize this: " + " ".join(
        f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(40))}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
OTHERS = [[{"role": "user", "content": f"Write story number {i} about " + "a cat and a dog " * (i % 7 + 1)}]
          for i in range(31)]
OTHER_PARAMS = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=6 + 3 * i) for i in range(31)]
KW = dict(max_model_len=1024, kv_cache_memory=256 << 20)   # no dtype: the default's


def greedy_run(output) -> tuple[list[int], list[dict[int, float]]]:
    c = output.outputs[0]
    return c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]


@pytest.mark.parametrize("quantization", [
    None,   # the file's blocks, as `make serve` runs them
    pytest.param("none", marks=pytest.mark.skipif(
        amx_gemv() is not None, reason="not on a CPU with AMX: linear_bf16_amx's tiles are not "
                                       "batch-invariant yet (docs/batch_invariance.md)")),   # dense bf16 layers, packed
])
def test_a_request_is_the_same_bits_alone_cached_in_a_batch_and_chunked(quantization):
    kw = dict(KW, quantization=quantization)
    llm = LLM(**kw)
    seen: dict[str, list] = {}
    for i, question in enumerate(QUESTIONS):
        alone = greedy_run(llm.chat([question], GREEDY, use_tqdm=False)[0])
        again = greedy_run(llm.chat([question], GREEDY, use_tqdm=False)[0])       # its prefix cached
        mixed = llm.chat(OTHERS[:i + 5] + [question] + OTHERS[i + 5:], OTHER_PARAMS[:i + 5] + [GREEDY]
                         + OTHER_PARAMS[i + 5:], use_tqdm=False)
        in_batch = greedy_run(mixed[i + 5])
        seen[f"q{i}"] = [alone, again, in_batch]
    answer = llm.get_tokenizer().decode(seen["q0"][0][0], skip_special_tokens=True)
    assert answer == "The capital of France is Paris.", answer   # the README's question, in bf16
    del llm
    chunked = LLM(max_num_batched_tokens=64, **kw)
    for i, question in enumerate(QUESTIONS):
        seen[f"q{i}"].append(greedy_run(chunked.chat([question], GREEDY, use_tqdm=False)[0]))
    for name, (alone, *others) in seen.items():
        for how, other in zip(("again (prefix cached)", "in a batch of 32", "in 64-token chunks"), others):
            assert other[0] == alone[0], (name, how)
            assert other[1] == alone[1], (name, how)   # logprobs: the same float32 bits


def test_make_serve_answers_the_readme_question_the_same_under_varying_load():
    """`kestrel serve` as `make serve` starts it (no --dtype): the README's question, greedy, answers
    "The capital of France is Paris." 10 times, each time beside 0 to 9 other requests in flight."""
    server = Server("--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    try:
        server.wait_ready()

        def other(i: int) -> int:
            return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": "SmolLM2-135M-Instruct", "prompt": f"Story {i}: once upon a time" + " again" * i,
                "max_tokens": 8 + 4 * i, "temperature": 0.7}).status_code

        answers = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
            for round_ in range(10):
                load = [pool.submit(other, round_ * 10 + j) for j in range(round_)]
                answers.append(chat_capital_of_france(server)["message"]["content"])
                assert all(f.result() == 200 for f in load)
        assert answers == ["The capital of France is Paris."] * 10, answers
    finally:
        server.stop()
