"""`kestrel bench latency` (workload W3): the engines' rounds run interleaved, every engine is sent
the same prompts, and the report carries the round-by-round TPOT ratios. Two real `kestrel serve`
processes stand in for Kestrel and a peer (llama-server is not built in the test environment)."""

from __future__ import annotations

import argparse

import pytest

from kestrel.bench import latency
from kestrel.bench.peers import KestrelServer
from tests.entrypoints.test_openai_server import SERVER_FLAGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_rounds_run_every_concurrency_in_turn():
    assert latency.rounds_to_run([1, 8], 2) == [(1, 0), (1, 1), (8, 0), (8, 1)]


def test_latency_rounds_interleave_engines(monkeypatch):
    launched: list[str] = []
    flags: list[list[str]] = []

    def launch(spec, kestrel_flags=(), **_):
        launched.append(spec)
        flags.append(list(kestrel_flags))
        return KestrelServer(SERVER_FLAGS)

    calls: list[tuple[str, int, tuple]] = []
    real_round = latency.run_round

    def recording_round(engine, requests, output_len):
        calls.append((engine.spec, len(requests), tuple(tuple(r.prompt_token_ids) for r in requests)))
        return real_round(engine, requests, output_len)

    monkeypatch.setattr(latency, "launch_server", launch)
    monkeypatch.setattr(latency, "run_round", recording_round)
    args = argparse.Namespace(input_len=12, output_len=4, concurrency=[1, 2], runs=2, kestrel_flags="",
                              kestrel_weights="bf16", model=None, peer=["llama-server:q8_0"])
    engines = latency.measure_engines(["kestrel", "peer"], args)

    assert launched == ["kestrel", "peer"]
    assert flags[0] == ["--quantization", "none"]   # the workload's bf16 weights
    # Each round goes to every engine in turn, with the same prompts, before the next round starts.
    assert [(spec, n) for spec, n, _ in calls] == [("kestrel", 1), ("peer", 1)] * 2 + [("kestrel", 2), ("peer", 2)] * 2
    for i in range(0, len(calls), 2):
        assert calls[i][2] == calls[i + 1][2]
    assert calls[0][2] != calls[2][2]   # rounds differ from each other
    for e in engines:
        assert [s["concurrency"] for s in e["settings"]] == [1, 2]
        for s in e["settings"]:
            assert len(s["rounds"]) == 2 and s["tpot_ms"] > 0 and s["ttft_ms"] > 0
        assert e["peak_rss_bytes"] > 0

    ratios = latency.paired_tpot_ratios(engines[0], engines[1])
    assert len(ratios) == 2 and all(len(r) == 2 and all(x > 0 for x in r) for r in ratios)
    report = {"engines": engines, "workload": {"id": "W3 (modified)", "input_len": 12, "output_len": 4,
                                               "concurrency": [1, 2], "runs": 2, "sampling": "greedy"},
              "command": "test", "date": "now", "machine": {"cpu_model": "cpu", "usable_cpus": 2, "bf16_flags": []},
              "load_average_at_start": [0, 0, 0], "load_average_at_end": [0, 0, 0]}
    md = latency.format_markdown(report)
    assert "round by round" in md and "ran interleaved" in md
    assert "Kestrel's weights: bf16, a GGUF file's blocks dequantized at load (--quantization none)" in md
    # A quantization named in --kestrel-flags is what Kestrel ran, and what the report says.
    report["workload"].update(kestrel_weights="bf16", kestrel_flags=["--dtype", "bfloat16", "--quantization=int8"])
    assert "Kestrel's weights: --quantization int8 (from --kestrel-flags)" in latency.format_markdown(report)
    report["workload"]["kestrel_flags"] = ["--quantization", "none"]
    assert "Kestrel's weights: bf16, a GGUF file's blocks dequantized" in latency.format_markdown(report)
    assert f"{ratios[0][0]:.2f}, {ratios[0][1]:.2f}" in latency.format_summary(report)
