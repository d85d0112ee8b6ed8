"""The OpenAI-compatible server (`kestrel serve`, issue 3), end to end: a real server process (API
server + engine-core process) on a free port, driven by the official `openai` client (sync and async,
streaming and not) and by raw httpx requests for the error cases.

Two servers are started once for the module, in parallel: the main one, and one that requires an API
key (given through KESTREL_API_KEY) with a served model name of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx2 as httpx
import openai
import pytest

from tests.support.server_process import Server, assert_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
API_KEY = "sk-kestrel-test"
KEYED_NAME = "keyed-model"
SERVER_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "128MiB", "--dtype", "float32"]

METRIC_NAMES = ["kestrel:num_requests_running", "kestrel:num_requests_waiting", "kestrel:kv_cache_usage_perc",
                "kestrel:prompt_tokens_total", "kestrel:generation_tokens_total",
                "kestrel:num_preemptions_total", "kestrel:prefix_cache_queries_total",
                "kestrel:prefix_cache_hits_total", "kestrel:time_to_first_token_seconds",
                "kestrel:inter_token_latency_seconds", "kestrel:e2e_request_latency_seconds",
                "kestrel:request_queue_time_seconds"]


@pytest.fixture(scope="module")
def servers():
    main = Server(*SERVER_FLAGS)
    keyed = Server("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--served-model-name", KEYED_NAME,
                   "--max-queued-requests", "2", env={"KESTREL_API_KEY": API_KEY}, held=True)
    try:
        main.wait_ready()
        keyed.wait_ready()
        yield main, keyed
    finally:
        main.stop()
        keyed.stop()
    assert main.proc.returncode == 0, f"the server did not shut down cleanly:\n{main.output()}"
    # 1 once test_engine_core_death_... has killed its engine core.
    assert keyed.proc.returncode == keyed.expected_returncode, keyed.output()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- the basics -----------------------------------------------------------------------------------

def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_answers_paris(client):
    r = client.chat.completions.create(model=MODEL, messages=chat_msgs("What is the capital of France?"),
                                       temperature=0, max_tokens=24)
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_async_matches_non_stream(server, client):
    messages = chat_msgs("Name three colours.")
    expected = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              max_completion_tokens=20)

    async def go():
        async with async_client(server) as ac:
            stream = await ac.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                      max_completion_tokens=20, stream=True,
                                                      stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(go())
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == expected.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == expected.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == expected.usage.prompt_tokens


def test_completion_sync_stream_and_async(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert r.object == "text_completion" and "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    async def go():
        async with async_client(server) as ac:
            return await ac.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)

    assert asyncio.run(go()).choices[0].text == r.choices[0].text


def test_sse_wire_format(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_prompt_forms_echo_and_default_max_tokens(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two, three,"],
                                  temperature=0, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1]
    r_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4)
    assert r_ids.choices[0].text == r.choices[0].text
    r_lists = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=4)
    assert [c.text for c in r_lists.choices] == [r.choices[0].text] * 2
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4,
                                     echo=True)
    assert echo.choices[0].text == "The capital of France is" + r.choices[0].text
    # No max_tokens: 16, as OpenAI's and vLLM's (null: up to max_model_len - prompt length).
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, stop=[" 6"])
    assert r.choices[0].finish_reason == "stop" and " 4, 5," in r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_concurrent_streams_equal_requests_run_alone(server, client):
    prompts = [f"Write a sentence about the number {i}." for i in range(32)]
    alone = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12).choices[0].text
             for p in prompts]

    async def one(ac, p):
        stream = await ac.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def go():
        async with async_client(server) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(go()) == alone


def test_stop_strings_never_streamed(client):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0].text
    assert "aris" in full
    for stop in (["aris"], ["xyz", "Paris."], [" Par"]):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                                stop=stop, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        assert not any(s in text for s in stop), (stop, text)
        assert chunks[-1].choices[0].finish_reason == "stop"
        cut = min(full.index(s) for s in stop if s in full)
        assert text == full[:cut]


def test_n_samples(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, temperature=1.0, seed=7,
                                  max_tokens=6)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat_msgs("Tell me a joke."), n=2,
                                                 temperature=1.0, seed=7, max_tokens=6, stream=True))
    finished = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finished == {0: "length", 1: "length"}
    roles = {ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"}
    assert roles == {0, 1}


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert top[tok] == pytest.approx(max(top.values()))  # greedy: the sampled token is the likeliest
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=5, logprobs=3, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset

    chat = client.chat.completions.create(model=MODEL, messages=chat_msgs("Say hi."), temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_echo_with_logprobs_scores_the_prompt(server, client):
    prompt = "The capital of France is"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(ids) >= 3
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=3, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value is not None and value <= 0
        assert 2 <= len(top) <= 3 and top[tok] == pytest.approx(value)
        assert max(top.values()) >= value
    # The last prompt token's distribution is the one a request for the shorter prompt samples from.
    short = client.completions.create(model=MODEL, prompt=ids[:-1], temperature=0, max_tokens=1, logprobs=2)
    expected, scored = short.choices[0].logprobs.top_logprobs[0], lp.top_logprobs[len(ids) - 1]
    assert all(t in scored and scored[t] == pytest.approx(v, abs=1e-3) for t, v in expected.items()), (expected,
                                                                                                        scored)
    # Streaming: the first chunk carries the echo with the same values.
    chunks = list(client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=3, logprobs=2,
                                            echo=True, stream=True))
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    # Without echo, nothing changes.
    plain = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=3, logprobs=2)
    assert plain.choices[0].logprobs.tokens == lp.tokens[len(ids):]


# ---- errors ---------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": 123}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "hi", "stream": True, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 5}, "prompt"),
    ({"prompt": "hi", "n": 100_000}, "n"),
    ({"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "top_k": 2**64}, "top_k"),
    ({"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_values_are_400(server, body, param):
    err = assert_error(httpx.post(f"{server.url}/v1/completions", json=body), 400, "BadRequestError")
    assert err["param"] == param


def test_bad_requests_are_400_never_5xx(server):
    url = server.url
    assert_error(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi",',
                            headers={"content-type": "application/json"}), 400, "BadRequestError", "JSON")
    assert_error(httpx.post(f"{url}/v1/completions", content=b"[1, 2]"), 400, "BadRequestError")
    assert_error(httpx.post(f"{url}/v1/chat/completions", content=b"\xff\xfe"), 400, "BadRequestError")
    assert_error(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}'), 400,
                 "BadRequestError")
    # (A custom role, "robot", is served as vLLM serves it: the chat template decides.)
    for body in ({"messages": []}, {"messages": "hi"}, {"messages": [{"role": 5, "content": "x"}]},
                 {"messages": chat_msgs("x"), "logprobs": True, "top_logprobs": 99},
                 {"messages": chat_msgs("x"), "max_completion_tokens": -3}):
        assert_error(httpx.post(f"{url}/v1/chat/completions", json=body), 400, "BadRequestError")
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [-1]}),
                       ("/detokenize", {"tokens": "abc"})):
        assert_error(httpx.post(f"{url}{path}", json=body), 400, "BadRequestError")


def test_too_long_prompt_names_both_numbers(server, client):
    prompt = "hello " * 300
    n_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["count"]
    assert n_prompt < MAX_MODEL_LEN
    err = assert_error(httpx.post(f"{server.url}/v1/completions",
                                  json={"prompt": prompt, "max_tokens": MAX_MODEL_LEN}), 400, "BadRequestError",
                       str(MAX_MODEL_LEN), str(n_prompt))
    assert err["param"] == "max_tokens"
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello " * 600}), 400,
                 "BadRequestError", str(MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=chat_msgs(prompt), max_tokens=MAX_MODEL_LEN)


def test_unknown_model_is_404(server, client):
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                 "NotFoundError", "gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=chat_msgs("hi"))
    assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404, "NotFoundError")


def test_oversized_body_is_413(server):
    big = json.dumps({"prompt": "a" * (9 << 20)}).encode()
    assert_error(httpx.post(f"{server.url}/v1/completions", content=big), 413, "RequestTooLargeError")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * (1 << 20)

    assert_error(httpx.post(f"{server.url}/v1/completions", content=chunks()), 413, "RequestTooLargeError")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key(servers):
    _, keyed = servers
    url = keyed.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert_error(httpx.get(f"{url}/v1/models"), 401, "AuthenticationError")
    assert_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401,
                 "AuthenticationError")
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}), 401, "AuthenticationError")
    ok = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == KEYED_NAME
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as good:
        r = good.completions.create(model=KEYED_NAME, prompt="The capital of France is", temperature=0,
                                    max_tokens=3)
        assert r.choices[0].text
        with pytest.raises(openai.NotFoundError):  # the served name replaces the model's own
            good.completions.create(model=MODEL, prompt="hi", max_tokens=3)


def test_full_queue_answers_429(servers):
    _, keyed = servers
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": KEYED_NAME, "prompt": "word " * 200, "max_tokens": 4, "temperature": 0}

    async def burst() -> tuple[list[httpx.Response], int]:
        # The engine core is held: no request gets an output, so the two admitted ones stay queued
        # while the burst arrives, however slowly the client sends it.
        keyed.hold()
        try:
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(c.post(f"{keyed.url}/v1/completions", json=body, headers=auth))
                         for _ in range(32)]
                deadline = time.monotonic() + 60
                while sum(t.done() for t in tasks) < 30 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                answered_while_held = sum(t.done() for t in tasks)
                keyed.release()
                return await asyncio.gather(*tasks), answered_while_held
        finally:
            keyed.release()

    responses, answered_while_held = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    # Two requests may wait for their first token; the rest are turned away at once, not queued.
    assert codes == [200] * 2 + [429] * 30, codes
    assert answered_while_held == 30
    assert_error(next(r for r in responses if r.status_code == 429), 429, "RateLimitError", "2 queued requests")
    ok = httpx.post(f"{keyed.url}/v1/completions", json=body, headers=auth, timeout=120)
    assert ok.status_code == 200  # served again once the queue drains


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_deeply_nested_json_is_400(server, path):
    for body in ("[" * 100_000 + "]" * 100_000, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 '{"a": ' * 100_000 + "1" + "}" * 100_000):
        r = httpx.post(f"{server.url}{path}", content=body.encode(), headers={"Content-Type": "application/json"})
        assert_error(r, 400, "BadRequestError", "nested too deeply")
    assert "RecursionError" not in server.output()


def test_health_answers_within_100ms_while_a_5mb_prompt_is_tokenized(server):
    """The chat template and the tokenizer run off the event loop: /health keeps answering at once."""
    message = "word " * (1 << 20)  # 5 MiB, about a million tokens: seconds of tokenizing
    big: dict = {}

    def send_big() -> None:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"messages": chat_msgs(message), "max_tokens": 1})
        big["done_at"], big["response"] = time.monotonic(), r

    sender = threading.Thread(target=send_big)
    started = time.monotonic()
    sender.start()
    polls = []  # (answered at, seconds taken)
    with httpx.Client(timeout=10) as c:
        while sender.is_alive() and time.monotonic() - started < 240:
            t0 = time.monotonic()
            assert c.get(f"{server.url}/health").status_code == 200
            polls.append((time.monotonic(), time.monotonic() - t0))
            time.sleep(0.02)
    sender.join()
    # Polls answered while the big request was in flight, from half a second after it was sent (its
    # 5 MiB are through localhost by then) until it was answered: it was being templated and tokenized.
    during = [took for at, took in polls if started + 0.5 < at < big["done_at"]]
    assert len(during) >= 5, (len(polls), big["done_at"] - started)
    assert max(during) < 0.1, sorted(during)[-5:]
    assert_error(big["response"], 400, "BadRequestError", "maximum context length")


# ---- tokenizer endpoints and metrics --------------------------------------------------------------

def test_tokenize_detokenize_round_trip(server):
    text = "Kestrels hover over fields."
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": chat_msgs(text)}).json()
    assert chat["count"] > tok["count"]
    assert text in httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]


def scrape(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$", line)
        if m and "le=" not in line:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def test_metrics_move(server, client):
    text = httpx.get(f"{server.url}/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'quantization="gguf"' in text   # the default model is a GGUF file, served without --quantization
    before = scrape(server)
    client.completions.create(model=MODEL, prompt="Counting: one, two,", temperature=0, max_tokens=6)
    after = scrape(server)
    assert after["kestrel:prompt_tokens_total"] > before["kestrel:prompt_tokens_total"]
    assert after["kestrel:generation_tokens_total"] >= before["kestrel:generation_tokens_total"] + 6
    assert after["kestrel:prefix_cache_queries_total"] > before["kestrel:prefix_cache_queries_total"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert after[f"kestrel:{hist}_count"] == before[f"kestrel:{hist}_count"] + 1, hist
    # One observation per gap between the 6 output tokens.
    assert after["kestrel:inter_token_latency_seconds_count"] == before["kestrel:inter_token_latency_seconds_count"] + 5
    assert 0.0 <= after["kestrel:kv_cache_usage_perc"] <= 1.0


def wait_until_idle(server, timeout_s: float = 10) -> dict[str, float]:
    """The metrics once no request runs and the KV pool is empty again; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(server)
        idle = values["kestrel:num_requests_running"] == 0 and values["kestrel:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, values
    return values


def test_client_disconnect_aborts_the_request(server):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert scrape(server)["kestrel:num_requests_running"] == 1
    # Gone mid-stream: the engine core drops the request and its KV blocks return to the pool.
    values = wait_until_idle(server)
    assert values["kestrel:generation_tokens_total"] < 10_000


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": chat_msgs("Tell me a long story."), "max_tokens": 400,
                              "ignore_eos": True}),
])
def test_client_disconnect_aborts_a_non_streaming_request(server, path, body):
    before = scrape(server)["kestrel:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # gives up long before 400 tokens, closing the connection
        httpx.post(f"{server.url}{path}", json=body, timeout=httpx.Timeout(60, read=1.5))
    values = wait_until_idle(server)
    assert values["kestrel:generation_tokens_total"] - before < 400


def test_sigint_shuts_down_cleanly_without_orphans():
    import psutil

    server = Server("--max-model-len", "256", "--kv-cache-memory", "16MiB")
    try:
        server.wait_ready()
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children, "the engine core should run in a child process"
        # A request in flight while the signal arrives still ends (with its tokens or an error).
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            start = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
            server.proc.wait(timeout=10)
        assert time.monotonic() - start < 10
        # The stream ended at once with one final error event (not cut off), then [DONE].
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert server.proc.returncode == 0, server.output()
        assert "Traceback" not in server.output(), server.output()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"orphan processes left: {alive}"
    finally:
        server.stop()


# Runs last: it kills the keyed server's engine core (a step failure is tested in test_engine_failure.py).
def test_engine_core_death_ends_requests_and_server_exits_non_zero(servers):
    import psutil

    _, keyed = servers
    url, auth = keyed.url, {"Authorization": f"Bearer {API_KEY}"}
    core = next(p for p in psutil.Process(keyed.proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline()))
    body = {"model": KEYED_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    keyed.expected_returncode = 1
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        core.kill()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - start < 15
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == 500 and "died" in error["message"], error
    # Until it exits, the server says it is down; then it exits non-zero for a supervisor to restart it.
    health = httpx.get(f"{url}/health")
    assert_error(health, 503, "ServiceUnavailableError", "not running")
    assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth,
                            timeout=10), 503, "ServiceUnavailableError")
    assert keyed.proc.wait(timeout=30) == 1, keyed.output()
