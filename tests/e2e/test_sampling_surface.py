"""The sampling settings users reach for (issue 21, item 3), end to end on a tiny random-weight model:
`logit_bias`, `allowed_token_ids`, `bad_words`, `min_tokens` with stop token ids, and `n` with
`best_of`, through the offline `LLM` and through the server with the `openai` client, with a 400 for
each value out of range."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from kestrel import LLM, SamplingParams
from tests.support.parity import save_tiny_llama
from tests.support.server_process import Server, assert_error

PROMPT = "Once upon a time"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def llm(tiny_folder):
    return LLM(str(tiny_folder), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 << 20)


def one_token_words(tokenizer, token_ids: list[int]) -> dict[str, int]:
    """Words (decoded tokens) whose bad-word tokenizations include the token alone: word → token."""
    words = {}
    for t in token_ids:
        word = tokenizer.decode([t])
        if word.strip() and any(tokenizer.encode(w, add_special_tokens=False) == [t]
                                for w in (word.lstrip(), " " + word.lstrip())):
            words[word] = t
    return words


# ---- offline ---------------------------------------------------------------------------------------

def test_logit_bias_forces_a_token(llm, engine_check):
    tokenizer = llm.get_tokenizer()
    forced = tokenizer.encode(" the", add_special_tokens=False)[0]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                              logit_bias={str(forced): 100}), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced] * 8
    # A negative bias keeps the plain greedy choice out.
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
    banned = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logit_bias={plain.token_ids[0]: -100}),
                          use_tqdm=False)[0].outputs[0]
    assert banned.token_ids != plain.token_ids
    engine_check(llm)


def test_allowed_token_ids_restrict_sampled_output(llm):
    allowed = [100, 2000, 30000, 45000]
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True,
                                              allowed_token_ids=allowed), use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.token_ids) == 16 and set(c.token_ids) <= set(allowed)


def test_bad_words_never_appear(llm):
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    words = one_token_words(tokenizer, plain.token_ids)
    assert words, plain.token_ids
    out = llm.generate(PROMPT, greedy.clone(bad_words=list(words)), use_tqdm=False)[0].outputs[0]
    assert not set(out.token_ids) & set(words.values())
    assert out.token_ids != plain.token_ids


def test_bad_words_are_tokenized_with_and_without_a_leading_space(llm):
    processor, tokenizer = llm.llm_engine.processor, llm.get_tokenizer()
    plain = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert plain != spaced and len(plain) == len(spaced) == 1
    assert processor.bad_words_token_ids(["hello", "  hello"]) == [plain, spaced, plain, spaced]
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(PROMPT, SamplingParams(bad_words=[""]), use_tqdm=False)


def test_min_tokens_holds_off_stop_token_ids(llm, engine_check):
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[1]
    early = llm.generate(PROMPT, greedy.clone(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert early.finish_reason == "stop" and early.stop_reason == stop_id and len(early.token_ids) <= 2
    late = llm.generate(PROMPT, greedy.clone(stop_token_ids=[stop_id], min_tokens=10), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10 and stop_id not in late.token_ids[:10]
    if late.finish_reason == "stop":
        assert late.token_ids[-1] == stop_id and late.stop_reason == stop_id
    engine_check(llm)


def test_best_of_returns_the_n_best_by_cumulative_logprob(llm, engine_check):
    sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=12)
    every = llm.generate(PROMPT, sampled.clone(n=5, logprobs=0), use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    best = llm.generate(PROMPT, sampled.clone(n=2, best_of=5), use_tqdm=False)[0]
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    # Not asked for: no logprobs in the output, though they were computed to rank the samples.
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best.outputs)
    assert best.num_generated_tokens == sum(len(c.token_ids) for c in every.outputs)
    # Asked for: they come with the chosen samples.
    with_logprobs = llm.generate(PROMPT, sampled.clone(n=2, best_of=5, logprobs=2), use_tqdm=False)[0]
    assert [c.cumulative_logprob for c in with_logprobs.outputs] == pytest.approx(
        [c.cumulative_logprob for c in ranked[:2]])
    # best_of == n is plain n.
    same = llm.generate(PROMPT, sampled.clone(n=5, best_of=5, logprobs=0), use_tqdm=False)[0]
    assert [c.token_ids for c in same.outputs] == [c.token_ids for c in every.outputs]
    with pytest.raises(ValueError, match="best_of"):
        llm.generate(PROMPT, sampled.clone(n=3, best_of=2), use_tqdm=False)
    engine_check(llm)


def test_token_ids_out_of_the_vocabulary_are_refused(llm):
    vocab = llm.llm_engine.config.model.vocab_size
    for field, params in (("logit_bias", SamplingParams(logit_bias={vocab: 1.0})),
                          ("allowed_token_ids", SamplingParams(allowed_token_ids=[0, vocab]))):
        with pytest.raises(ValueError, match=f"^{field} has token ids out of range"):
            llm.generate(PROMPT, params, use_tqdm=False)


# ---- the server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_folder):
    server = Server("--model", str(tiny_folder), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                    "--kv-cache-memory", "16MiB")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_folder)


@pytest.mark.slow
def test_server_logit_bias_forces_a_token(client, model, tokenizer):
    forced = tokenizer.encode(" the", add_special_tokens=False)[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == " the" * 6
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == " the" * 4


@pytest.mark.slow
def test_server_allowed_token_ids_and_bad_words(client, model, tokenizer):
    allowed = {w: tokenizer.encode(w, add_special_tokens=False)[0] for w in (" cat", " dog", " bird")}
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2,
                                  extra_body={"allowed_token_ids": list(allowed.values()), "ignore_eos": True})
    for c in r.choices:
        assert c.text and set(c.text.split()) <= {"cat", "dog", "bird"}

    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in plain.logprobs.tokens]
    words = one_token_words(tokenizer, [i[0] for i in ids if len(i) == 1])
    assert words
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True, "bad_words": list(words)}).choices[0]
    assert not set(banned.logprobs.tokens) & set(words)
    assert banned.text != plain.text


@pytest.mark.slow
def test_server_min_tokens_with_stop_token_ids(client, model, tokenizer):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True}).choices[0]
    stop_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(plain.logprobs.tokens[1]))[0]
    early = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens <= 2
    late = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 8})
    assert late.usage.completion_tokens >= 8


@pytest.mark.slow
def test_server_best_of(client, model):
    every = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, n=4,
                                      logprobs=0)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(model=model, prompt=[PROMPT, PROMPT], max_tokens=10, temperature=1.0, seed=5,
                                     n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] * 2
    assert all(c.logprobs is None for c in best.choices)
    # Usage counts every sample generated, the dropped ones too.
    assert best.usage.completion_tokens == 2 * every.usage.completion_tokens
    assert best.usage.prompt_tokens == 2 * every.usage.prompt_tokens


BAD = [
    ({"best_of": 1, "n": 2}, "best_of", "at least n"),
    ({"best_of": 0}, "best_of", ""),
    ({"best_of": 1000}, "best_of", "at most"),
    ({"best_of": 3, "n": 2, "stream": True}, "best_of", "streamed"),
    ({"best_of": "two"}, "best_of", ""),
    ({"logit_bias": {"999999": 1.0}}, "logit_bias", "out of range"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias", ""),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", ""),
    ({"logit_bias": {"5": "high"}}, "logit_bias", ""),
    ({"logit_bias": [1, 2]}, "logit_bias", ""),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [1, 999999]}, "allowed_token_ids", "out of range"),
    ({"allowed_token_ids": [2**70]}, "allowed_token_ids", ""),
    ({"bad_words": [""]}, "bad_words", ""),
    ({"bad_words": "word"}, "bad_words", ""),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", ""),
    ({"min_tokens": -1}, "min_tokens", ""),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra, param, fragment", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_server_out_of_range_values_are_400(server, extra, param, fragment):
    body = {"prompt": PROMPT, "max_tokens": 4, **extra}
    err = assert_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 400, "BadRequestError",
                       fragment)
    assert err["param"] == param, err
    if param != "best_of":  # chat has these too (best_of is the completions API's)
        chat = {"messages": [{"role": "user", "content": "hi"}], **body}
        del chat["prompt"]
        err = assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30), 400,
                           "BadRequestError", fragment)
        assert err["param"] == param, err
