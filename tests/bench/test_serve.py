"""`kestrel bench serve` (workload W2's load client), end to end against a real `kestrel serve`
process on a free port (started the way tests/entrypoints/test_openai_server.py starts its server), and against a
dead port: every request must count as failed, and the run must still produce its report."""

from __future__ import annotations

import json

import pytest

from kestrel.bench import serve as bench_serve
from kestrel.bench.workloads import random_requests
from kestrel.entrypoints.cli import main as cli_main
from tests.entrypoints.test_openai_server import SERVER_FLAGS
from tests.support.server_process import Server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SMALL = ["--num-prompts", "6", "--request-rate", "20", "--input-len-range", "16", "32",
         "--output-len-range", "4", "8"]


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_FLAGS)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_bench_serve_against_kestrel(server, tmp_path):
    out, md = tmp_path / "serve.json", tmp_path / "BENCH.md"
    # Through the CLI, with the model name taken from GET /v1/models.
    rc = cli_main(["bench", "serve", "--base-url", f"{server.url}/v1", *SMALL, "--label", "kestrel",
                   "--output-json", str(out), "--append-md", str(md), "--timeout", "120"])
    assert rc == 0
    report = json.loads(out.read_text())
    res = report["results"]
    expected = random_requests(6, (16, 32), (4, 8), seed=0)
    assert report["model"] == "SmolLM2-135M-Instruct"
    assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
    assert res["output_tokens"] == sum(r.output_len for r in expected)
    assert report["workload"]["output_tokens"] == sum(r.output_len for r in expected)
    assert res["input_tokens"] == sum(r.input_len for r in expected)
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        for stat in ("mean", "p50", "p99"):
            assert res[metric][stat] > 0, (metric, stat, res[metric])
    assert res["output_tok_s"] > 0 and res["request_throughput"] > 0 and res["wall_s"] > 0
    for r in report["requests"]:
        assert r["ok"] and r["usage_reported"] and r["output_tokens"] == r["requested_output_len"]
        assert 0 < r["ttft_s"] < r["e2e_s"] and r["tpot_s"] > 0
        assert len(r["itl_s"]) >= 1 and all(g > 0 for g in r["itl_s"])
    assert report["workload"]["id"] == "W2 (reduced)" and not report["notes"]
    assert "online serving" in md.read_text() and "TTFT ms" in md.read_text()


def test_bench_serve_dead_port_counts_failures():
    url = f"http://127.0.0.1:{free_port()}/v1"   # nothing listens there
    report = bench_serve.run(bench_serve.parse_args(["--base-url", url, *SMALL, "--timeout", "10"]))
    res = report["results"]
    assert res["completed"] == 0 and res["failed"] == 6
    assert res["output_tokens"] == 0 and res["ttft_ms"]["mean"] is None and res["errors"]
    assert any("GET /models failed" in n for n in report["notes"])
    assert "6 failed" in bench_serve.format_summary(report)


def test_arrival_times_are_poisson_from_the_seed():
    times = bench_serve.arrival_times(1000, 2.0, seed=0)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert 400 < times[-1] < 600   # ~ n / rate
    assert times == bench_serve.arrival_times(1000, 2.0, seed=0)
    assert bench_serve.arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_kestrel_variants_are_servers_with_flags_added():
    from kestrel.bench.launch import check_spec, launch_server, peer_label
    assert check_spec("kestrel:--async-scheduling --max-num-seqs 8") == "kestrel:--async-scheduling --max-num-seqs 8"
    for bad in ("kestrel:", "kestrel: ", "vllm"):
        with pytest.raises(ValueError, match="unknown server"):
            check_spec(bad)
    server = launch_server("kestrel:--async-scheduling --max-num-seqs 8", parallel=1, ctx_per_slot=64,
                           kestrel_flags=["--dtype", "float32"])
    assert server.engine_flags == ["--dtype", "float32", "--async-scheduling", "--max-num-seqs", "8"]
    assert peer_label("kestrel:--async-scheduling") == "kestrel:--async-scheduling"


def test_launched_servers_run_interleaved_with_the_prefix_cache_emptied(monkeypatch):
    """`--launch A --launch B --runs 2`: both servers up, then A, B, A, B; Kestrel's cache reset before each."""
    from kestrel.bench import launch as bench_launch
    from kestrel.bench.peers import KestrelServer
    order: list[str] = []
    resets: list[str] = []
    variant = ["--max-num-seqs", "4"]
    monkeypatch.setattr(bench_launch, "launch_server",
                        lambda spec, **_: KestrelServer(SERVER_FLAGS + (variant if ":" in spec else [])))
    real_reset = bench_serve._reset_prefix_cache
    monkeypatch.setattr(bench_serve, "_reset_prefix_cache", lambda url: (resets.append(url), real_reset(url)))
    real_run = bench_serve.run
    monkeypatch.setattr(bench_serve, "run", lambda a: (order.append(a.label), real_run(a))[1])
    args = bench_serve.parse_args(["--launch", "kestrel", "--launch", "kestrel:--max-num-seqs 4", "--runs", "2",
                                   "--num-prompts", "3", "--request-rate", "inf", "--input-len-range", "8", "16",
                                   "--output-len-range", "2", "4"])
    report = bench_serve.run_launched(args)
    assert order == ["kestrel", "kestrel:--max-num-seqs 4"] * 2
    assert len(resets) == 4 and len(set(resets)) == 2
    assert [e["spec"] for e in report["engines"]] == ["kestrel", "kestrel:--max-num-seqs 4"]
    assert all(e["median"]["completed"] == 6 and e["median"]["failed"] == 0 for e in report["engines"])
