"""`kestrel doctor` (issue 20): each diagnosis from figures, then induced on a real server (a tiny KV
pool, `--max-num-seqs 1`, a small prefill budget, a flood of tokenizing, a float32 eager model) and
read from the command's own output."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Callable

import httpx2 as httpx
import pytest

from kestrel.entrypoints.doctor import Figures, diagnose
from tests.support.parity import save_tiny_llama
from tests.support.server_process import Server

WINDOW_S = "4"


def figures(**overrides) -> Figures:
    base = dict(seconds=5.0, waiting=0, running=1, kv_usage=0.1, preemptions=0, requests_finished=3,
                prompt_tokens=100, generation_tokens=200, steps=200, batch=1.0, tokens_per_step=1.5, step_ms=20.0,
                phase_ms={"schedule": 0.1, "prepare_inputs": 0.5, "forward": 17.0, "sample": 1.5},
                engine_busy=0.9, api_cpu=0.1, ttft_p50=0.05, itl_p50=0.02, queue_p50=0.001,
                config={"max_num_seqs": "256", "max_num_batched_tokens": "2048", "num_gpu_blocks": "100",
                        "dtype": "bfloat16", "enforce_eager": "False", "quantization": "none"})
    return Figures(**{**base, **overrides})


@pytest.mark.parametrize("overrides, box, flag", [
    (dict(waiting=5, kv_usage=0.97, preemptions=4), "kv_cache_manager", "--kv-cache-memory"),
    (dict(waiting=5, kv_usage=0.2, queue_p50=0.8, running=1, config={"max_num_seqs": "1"}), "scheduler",
     "--max-num-seqs"),
    (dict(api_cpu=0.98, engine_busy=0.1), "api_server", "--max-queued-requests"),
    (dict(config={"dtype": "float32", "enforce_eager": "True"}), "model_runner", "--enforce-eager"),
])
def test_each_symptom_names_its_box_and_flag(overrides, box, flag):
    finding = diagnose(figures(**overrides), traces=[])
    assert finding.box == box
    assert any(flag in f for f in finding.flags), finding.flags


def test_int8_is_suggested_for_unquantized_weights_only():
    """A GGUF model on its file's blocks (label "gguf") reads fewer bytes a step than int8 would."""
    plain = diagnose(figures(), traces=[])
    gguf = diagnose(figures(config={**figures().config, "quantization": "gguf"}), traces=[])
    assert plain.box == gguf.box == "model_runner"
    assert any("--quantization int8" in f for f in plain.flags)
    assert not any("--quantization int8" in f for f in gguf.flags)


def test_chunked_prefill_is_read_from_the_traces():
    traces = [{"ttft_ms": 900.0, "prefill_chunks": 7, "boxes_ms": {}}, {"ttft_ms": 850.0, "prefill_chunks": 6}]
    finding = diagnose(figures(batch=8.0, config={"max_num_batched_tokens": "32"}), traces)
    assert finding.box == "scheduler" and "chunked-prefill" in finding.verdict
    assert "up to 7" in finding.evidence[0]
    assert any("--max-num-batched-tokens" in f for f in finding.flags)


def test_prefill_steps_of_preempted_requests_are_not_the_chunked_prefill_budget():
    """A preempted request computes its tokens again, in more prefill steps: the trace's prefill_chunks
    then count those, which the prefill budget did not cause (seen under a tiny KV pool)."""
    traces = [{"ttft_ms": 900.0, "prefill_chunks": 5, "preemptions": 2}, {"ttft_ms": 850.0, "prefill_chunks": 3,
                                                                          "preemptions": 1}]
    finding = diagnose(figures(batch=8.0, config={"max_num_batched_tokens": "2048"}), traces)
    assert "chunked-prefill" not in finding.verdict


def test_short_queueing_between_two_steps_is_not_a_diagnosis():
    finding = diagnose(figures(waiting=1, queue_p50=0.001), traces=[])
    assert finding.box == "model_runner"


def test_an_idle_server_has_nothing_to_diagnose():
    finding = diagnose(figures(steps=0, requests_finished=0, running=0, waiting=0, engine_busy=0.0), traces=[])
    assert finding.box == "none" and "idle" in finding.verdict


# ---- induced on a real server ---------------------------------------------------------------------

def doctor(server: Server) -> str:
    out = subprocess.run([sys.executable, "-m", "kestrel.entrypoints.cli", "doctor", server.url, "--window", WINDOW_S],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    return out.stdout


def under_load(server: Server, clients: int, request: Callable[[httpx.Client, int], None]) -> str:
    """The doctor's output while `clients` threads send `request` in a loop."""
    stop, errors = threading.Event(), []

    def loop(i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                try:
                    request(c, i)
                except Exception as e:  # reported below; the doctor's run goes on
                    errors.append(e)
                    return

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        return doctor(server)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors


def post_completion(url: str, prompt: str, max_tokens: int) -> Callable[[httpx.Client, int], None]:
    """A completion of `prompt` behind a number of its own (no prefix-cache hit on the whole prompt)."""
    numbers = itertools.count()

    def send(c: httpx.Client, i: int) -> None:
        r = c.post(f"{url}/v1/completions", json={"prompt": f"{next(numbers)} {prompt}", "max_tokens": max_tokens,
                                                  "ignore_eos": True})
        assert r.status_code == 200, r.text
    return send


def diagnosis(server: Server, clients: int, request: Callable[[httpx.Client, int], None]) -> str:
    """The doctor's output under that load; the server is stopped afterwards."""
    try:
        return under_load(server, clients, request)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(folder)
    return str(folder)


def tiny_server(model: str, *flags: str) -> Server:
    server = Server("--model", model, "--dtype", "float32", "--request-trace-buffer", "50", *flags)
    server.wait_ready()
    return server


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_kv_pool_is_kv_cache_memory(tiny_model):
    server = tiny_server(tiny_model, "--max-model-len", "192", "--num-kv-blocks", "14")
    out = diagnosis(server, 6, post_completion(server.url, "Once upon a time", 100))
    assert "limiting box: kv_cache_manager" in out, out
    assert "preemptions" in out and "--kv-cache-memory" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_sequence_at_a_time_is_the_scheduler_then_a_tokenizing_flood_is_the_front_end(tiny_model):
    server = tiny_server(tiny_model, "--max-model-len", "512", "--kv-cache-memory", "16MiB", "--max-num-seqs", "1")
    try:
        out = under_load(server, 4, post_completion(server.url, "Once upon a time", 40))
        assert "limiting box: scheduler" in out and "--max-num-seqs" in out, out
        assert "max_num_seqs 1" in out

        text = "the quick brown fox jumps over the lazy dog " * 20000  # ~900 KB to tokenize per call

        def flood(c: httpx.Client, i: int) -> None:
            if i == 0:  # one client keeps generating, waiting behind the tokenizer
                post_completion(server.url, "Once upon a time", 8)(c, i)
            else:
                assert c.post(f"{server.url}/tokenize", json={"prompt": text}).status_code == 200
        out = under_load(server, 4, flood)
        assert "limiting box: api_server" in out, out
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_long_prompts_in_small_chunks_are_the_prefill_budget(tiny_model):
    server = tiny_server(tiny_model, "--max-model-len", "512", "--kv-cache-memory", "16MiB",
                         "--max-num-batched-tokens", "32")
    prompt = " ".join(f"word{i}" for i in range(120))
    out = diagnosis(server, 1, post_completion(server.url, prompt, 1))
    assert "limiting box: scheduler" in out and "chunked-prefill" in out, out
    assert "--max-num-batched-tokens" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_float32_eager_model_one_request_at_a_time_is_the_model_runner():
    server = Server("--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    server.wait_ready()
    out = diagnosis(server, 1, post_completion(server.url, "Once upon a time", 64))
    assert "limiting box: model_runner" in out, out
    assert "--enforce-eager" in out and "--dtype bfloat16" in out
