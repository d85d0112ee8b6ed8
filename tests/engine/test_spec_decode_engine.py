"""Speculative decoding through the engine (issue 19): greedy outputs token-identical with and without
n-gram speculation, on the default model and a tiny random one, alone and in mixed batches, with
chunked prefill, prefix-cache hits and preemption; sampling parameters keep their meaning; metrics."""

from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams
from tests.support.parity import save_tiny_llama

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=128 << 20)

TEXTS = [
    # Outputs that repeat their prompts: most drafts are accepted.
    "Copy the list exactly.\nList: red, orange, yellow, green, blue, indigo, violet, black, white, grey.\n"
    "Copy: red, orange,",
    "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
    "def area(w, h):\n",
    # Ordinary prompts: few drafts, mostly rejected.
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived a",
]


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    return LLM(**KW)


@pytest.fixture(scope="module")
def speculative():
    return LLM(**KW, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def expected(plain):
    return token_ids(plain, TEXTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))


GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def test_greedy_tokens_are_the_same_with_speculation(speculative, expected):
    before = speculative.llm_engine.spec_decoding_stats.num_accepted_tokens
    assert token_ids(speculative, TEXTS, GREEDY) == expected
    stats = speculative.llm_engine.spec_decoding_stats
    # The repetitive prompts' outputs are mostly accepted drafts.
    assert stats.num_accepted_tokens - before > 64
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    # Alone, one request at a time.
    for text, tokens in zip(TEXTS, expected):
        assert token_ids(speculative, [text], GREEDY) == [tokens]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-spec")
    save_tiny_llama(folder)
    return folder


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random token runs repeated, so that prompt lookup finds n-grams; some short, some long."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        run = [rng.randrange(100, 49000) for _ in range(rng.choice([3, 5, 8, 13]))]
        prompts.append((run * (2 + i % 4))[: 4 + 11 * i])
    return prompts


TINY_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


@pytest.mark.parametrize("case", ["batched", "chunked-prefill", "preemption", "prefix-hits", "disable-by-batch-size"])
def test_tiny_model_greedy_identical(tiny_folder, case):
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    extra = {"batched": {}, "chunked-prefill": dict(max_num_batched_tokens=16),
             "preemption": dict(num_kv_blocks=20, enable_prefix_caching=False),
             "prefix-hits": {}, "disable-by-batch-size": {}}[case]
    spec = NGRAM
    if case == "disable-by-batch-size":  # 8 requests run without drafts; the 3 long ones speculate once alone
        spec = {**NGRAM, "disable_by_batch_size": 4}
        params = [SamplingParams(temperature=0, max_tokens=8 if i < 5 else 40, ignore_eos=True) for i in range(8)]
    want = token_ids(LLM(str(tiny_folder), **TINY_KW), prompts, params)
    llm = LLM(str(tiny_folder), **TINY_KW, **extra, speculative_config=spec)
    if case == "prefix-hits":
        token_ids(llm, prompts, params)  # the second run finds every prompt in the cache
    assert token_ids(llm, prompts, params) == want
    stats = llm.llm_engine.spec_decoding_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    if case == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0


# ---- sampling parameters keep their meaning -------------------------------------------------------

def texts_of(llm: LLM, prompts, params) -> list[tuple[str, list[int], str | None]]:
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),              # ends inside an accepted run
    SamplingParams(temperature=0, max_tokens=64, stop=[" green"]),            # a stop string among drafts
    SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=0.4, presence_penalty=0.3,
                   repetition_penalty=1.1),                                    # drafts count as output
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=20, stop_token_ids=[11]),
    # Drafts count as output for bad words (issue 21); bias and allowed ids apply to every verified row.
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, bad_words=[" green", "perimeter"]),
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logit_bias={"28": 2.0, "30": -3.0}),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=list(range(100, 5000))),
], ids=["max-tokens", "stop-string", "penalties", "min-tokens", "bad-words", "logit-bias", "allowed-token-ids"])
def test_sampling_parameters_keep_their_meaning(plain, speculative, params):
    assert texts_of(speculative, TEXTS, params) == texts_of(plain, TEXTS, params)


def test_logprobs_are_those_without_speculation(plain, speculative):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    ours = speculative.generate(TEXTS[:2], params, use_tqdm=False)
    theirs = plain.generate(TEXTS[:2], params, use_tqdm=False)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-4)
                assert step_a[token].rank == step_b[token].rank


def test_greedy_requests_beside_sampled_ones(speculative, expected):
    """A batch mixing greedy requests with sampled ones (seeded: the same tokens every time)."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    prompts = TEXTS + TEXTS[:2]
    params = [GREEDY] * len(TEXTS) + [sampled] * 2
    first = token_ids(speculative, prompts, params)
    assert first[:len(TEXTS)] == expected
    assert all(len(t) == 40 for t in first[len(TEXTS):])
    assert token_ids(speculative, prompts, params)[len(TEXTS):] == first[len(TEXTS):]
    assert token_ids(speculative, TEXTS[:2], sampled) == first[len(TEXTS):]  # alone: the same


# ---- the server ---------------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_server_with_ngram_speculation_answers_and_counts_drafts():
    import httpx2 as httpx

    from tests.support.server_process import Server, chat_capital_of_france
    server = Server("--speculative-config", '{"method":"ngram","num_speculative_tokens":4}', "--dtype", "float32",
                    "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    try:
        server.wait_ready()
        assert chat_capital_of_france(server)["message"]["content"] == "The capital of France is Paris."
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 40, "prompt": TEXTS[0]})
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{server.url}/metrics").text
        values: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith("kestrel:spec_decode"):
                name = line.split("{")[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        drafts = values["kestrel:spec_decode_num_drafts_total"]
        accepted = values["kestrel:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0, metrics
        assert 0 < accepted <= values["kestrel:spec_decode_num_draft_tokens_total"]
        # Per position, summed over the 4 positions: every accepted token once.
        assert values["kestrel:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
        assert metrics.count("kestrel:spec_decode_num_accepted_tokens_per_pos_total{") == 4
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()
