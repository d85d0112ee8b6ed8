"""Async scheduling through the engine (issue 19): the same tokens as without it, greedy and sampled,
with every sampling parameter; through the server, with streaming, stop strings and a client that
goes away. (Greedy parity with transformers under async scheduling is in the parity tests.)"""

from __future__ import annotations

import random

import pytest

from kestrel import LLM, SamplingParams
from tests.support.parity import save_tiny_llama

pytestmark = pytest.mark.slow

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-async")
    save_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def engines(tiny_folder):
    return LLM(str(tiny_folder), **KW), LLM(str(tiny_folder), **KW, async_scheduling=True)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(rng.randint(1, 60))]} for _ in range(n)]


PARAMS = [
    SamplingParams(temperature=1.0, seed=7, max_tokens=20),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, max_tokens=20),
    SamplingParams(temperature=1.0, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, max_tokens=20),
    SamplingParams(temperature=0, max_tokens=20, logprobs=3, min_tokens=5),
    SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=12),
]


@pytest.mark.parametrize("params", PARAMS, ids=["seeded", "top-k-p-min-p", "penalties", "logprobs-min-tokens", "n3"])
def test_the_same_outputs_with_and_without(engines, params, engine_check):
    sync, overlapped = engines
    batch = prompts(6)
    want = sync.generate(batch, params, use_tqdm=False)
    got = overlapped.generate(batch, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        if params.logprobs is not None:
            for cw, cg in zip(w.outputs, g.outputs):
                assert [sorted(s) for s in cg.logprobs] == [sorted(s) for s in cw.logprobs]
                for sw, sg in zip(cw.logprobs, cg.logprobs):
                    for t in sw:
                        assert sg[t].logprob == pytest.approx(sw[t].logprob, abs=1e-5)
    engine_check(overlapped)


def test_stops_end_where_they_end_without(engines, engine_check):
    """EOS (not ignored), stop token ids and stop strings: the step planned after the stop is dropped."""
    sync, overlapped = engines
    batch = prompts(6, seed=1)
    base = sync.generate(batch, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stop_ids = [o.outputs[0].token_ids[7] for o in base]  # each request meets its stop token mid-way
    text = base[0].outputs[0].text
    stop_string = text[len(text) // 2:len(text) // 2 + 3]
    reasons = []
    for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids),
                   SamplingParams(temperature=0, max_tokens=30, stop=[stop_string] if stop_string.strip() else None),
                   SamplingParams(temperature=0, max_tokens=30)):
        want = sync.generate(batch, params, use_tqdm=False)
        got = overlapped.generate(batch, params, use_tqdm=False)
        assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == \
               [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in want]
        reasons.extend(o.outputs[0].finish_reason for o in got)
    assert reasons.count("stop") >= 6, reasons
    engine_check(overlapped)


def test_server_with_async_scheduling():
    import httpx2 as httpx

    from tests.support.server_process import Server, chat_capital_of_france
    server = Server("--async-scheduling", "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    try:
        server.wait_ready()
        assert chat_capital_of_france(server)["message"]["content"] == "The capital of France is Paris."
        body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 24,
                "prompt": "Once upon a time, in a small village at the edge of a great forest, there lived a"}
        whole = httpx.post(f"{server.url}/v1/completions", timeout=120, json=body).json()["choices"][0]["text"]
        pieces = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json
                    pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
        assert "".join(pieces) == whole and len(whole) > 20
        # A stream closed early: the request ends, the server goes on answering.
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={**body, "max_tokens": 200, "stream": True}) as r:
            next(r.iter_lines())
        assert httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200
        assert chat_capital_of_france(server)["message"]["content"] == "The capital of France is Paris."
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()
