"""Tests of the `kestrel` command line (kestrel.entrypoints.cli) and `kestrel bench throughput`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from kestrel.bench.workloads import w1_offline_throughput
from kestrel.config import cpu_supports_bf16
from kestrel.engine.arg_utils import EngineArgs, create_engine_config
from kestrel.entrypoints.cli import ENGINE_FLAGS, build_parser, engine_kwargs, main, parse_bytes

os.environ["HF_HUB_OFFLINE"] = "1"
SLOW_TIMEOUT_S = 600  # the machine is shared; a busy neighbour can triple a run


def run_kestrel(*args: str, stdin: str | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kestrel.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, cwd=cwd, timeout=SLOW_TIMEOUT_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


# ---- fast -----------------------------------------------------------------------------------------

def test_every_engine_flag_sets_an_engine_args_field():
    assert {f.field for f in ENGINE_FLAGS} <= EngineArgs.field_names()
    assert len({f.flag for f in ENGINE_FLAGS}) == len(ENGINE_FLAGS)


def test_only_flags_given_reach_engine_args():
    args = build_parser().parse_args(["generate", "hi", "--dtype", "float32", "--no-enable-prefix-caching",
                                      "--no-enable-chunked-prefill", "--kv-cache-memory", "512MiB",
                                      "--max-num-seqs", "8", "--enforce-eager"])
    assert engine_kwargs(args) == {"dtype": "float32", "enable_prefix_caching": False,
                                   "enable_chunked_prefill": False, "kv_cache_memory": 512 << 20,
                                   "max_num_seqs": 8, "enforce_eager": True}
    assert engine_kwargs(build_parser().parse_args(["generate", "hi"])) == {}


def test_switches_and_parallel_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--enforce-eager", "--disable-log-stats", "--attention-backend",
                                      "torch", "-tp", "1", "--pipeline-parallel-size", "1", "-dp", "1",
                                      "--distributed-executor-backend", "uni"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"enforce_eager": True, "disable_log_stats": True, "attention_backend": "torch",
                      "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                      "distributed_executor_backend": "uni"}
    config, _, _ = create_engine_config(EngineArgs(**kwargs))  # reads the model's config, loads no weights
    assert (config.enforce_eager, config.disable_log_stats, config.attention_backend) == (True, True, "torch")
    assert config.parallel.world_size == 1 and config.parallel.distributed_executor_backend == "uni"
    default, _, _ = create_engine_config(EngineArgs())
    assert (default.enforce_eager, default.disable_log_stats, default.attention_backend) == (False, False, "auto")
    # --dtype auto on a CPU: bf16 where it computes faster (bf16 instructions, or the AVX2 build's kernels).
    from kestrel import ops
    assert default.model.dtype == (torch.bfloat16 if ops.cpu_prefers_bf16() else torch.float32)


PRODUCT_COMMANDS_SCRIPT = """
import sys
from kestrel.entrypoints import cli
cli.parse_args(["generate", "hi"])
cli.parse_args(["chat"])
try:
    cli.main(["serve", "--help"])
except SystemExit:
    pass
loaded = sorted(m for m in sys.modules if m.startswith("kestrel.bench"))
assert not loaded, loaded
cli.parse_args(["bench", "throughput", "--runs", "1"])
assert "kestrel.bench.throughput" in sys.modules
"""


def test_product_commands_do_not_import_the_benchmarks():
    result = subprocess.run([sys.executable, "-c", PRODUCT_COMMANDS_SCRIPT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("2GiB", 2 << 30), ("512MiB", 512 << 20),
                                           ("512 mib", 512 << 20), ("1.5GB", 1_500_000_000), ("1k", 1000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 GiBs", "-1", "1e9"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_serve_parses_its_flags(monkeypatch):
    args = build_parser().parse_args(["serve", "model.gguf", "--host", "0.0.0.0", "--port", "9000",
                                      "--api-key", "k", "--served-model-name", "m", "--max-model-len", "512",
                                      "--kv-cache-memory", "128MiB"])
    assert (args.model_tag, args.host, args.port, args.api_key, args.served_model_name) == \
        ("model.gguf", "0.0.0.0", 9000, "k", "m")
    assert engine_kwargs(args) == {"max_model_len": 512, "kv_cache_memory": 128 << 20}
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.model_tag, defaults.host, defaults.port, defaults.api_key) == (None, "127.0.0.1", 8000, None)
    # `kestrel serve` hands over to the server (the real one is tested in test_openai_server.py).
    seen = []
    monkeypatch.setattr("kestrel.entrypoints.openai.api_server.run_server", lambda a: seen.append(a) or 0)
    assert main(["serve", "--port", "9001"]) == 0
    assert seen[0].port == 9001


def test_serve_with_two_models_is_an_error(capsys, tmp_path):
    assert main(["serve", "a.gguf", "--model", "b.gguf"]) == 1
    assert capsys.readouterr().err.startswith("error: two models given")


def test_bad_model_path_is_an_error_without_traceback(tmp_path):
    result = run_kestrel("generate", "hello", "--model", str(tmp_path / "missing.gguf"))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_engine_value_is_an_error(capsys, tmp_path):
    assert main(["generate", "hello", "--model", str(tmp_path)]) == 1  # an empty folder is not a model
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a model folder" in err


def test_w1_workload_is_fixed_by_its_seed():
    a, b = w1_offline_throughput(), w1_offline_throughput()
    assert a == b and len(a) == 64
    assert all(64 <= r.input_len <= 512 and 32 <= r.output_len <= 256 for r in a)
    assert all(100 <= t <= 40000 for r in a for t in r.prompt_token_ids)


# ---- slow: the real default model -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_generate_prints_the_completion():
    result = run_kestrel("generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
                         "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "Paris" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_throughput_writes_json(tmp_path):
    result = run_kestrel("bench", "throughput", "--num-prompts", "4", "--input-len-range", "16", "32",
                         "--output-len-range", "4", "8", "--runs", "1", "--output-json", "tmp.json",
                         "--append-md", "BENCHMARKS.md", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "tmp.json").read_text())
    [kestrel] = report["results"]
    assert report["workload"]["num_requests"] == 4
    assert 4 * 4 <= kestrel["output_tokens"] <= 4 * 8
    assert kestrel["output_tok_s"] > 0 and kestrel["total_tok_s"] > kestrel["output_tok_s"]
    assert kestrel["wall_s"] > 0 and len(kestrel["run_wall_s"]) == 1
    assert kestrel["peak_rss_bytes"] > 0 and kestrel["mean_ttft_s"] > 0
    assert report["ratios_output_tok_s"] == {}
    assert report["command"].startswith("kestrel bench throughput --num-prompts 4")
    assert report["machine"]["logical_cpus"] >= 1
    roof = report["roofline"]
    assert roof["bf16_gflops"] > 0 and roof["fp32_gflops"] > 0 and roof["copy_gb_s"] > 0
    # SmolLM2-135M: 30 layers of 3.54 M parameters, a 49152 x 576 output head.
    assert roof["non_embedding_params"] == 30 * 3_540_096 + 576
    assert roof["output_head_params"] == 49152 * 576
    # The roofline is the matmul rate in the dtype the model computes in (float32 on a CPU without bf16).
    dtype = report["engine"]["dtype"]
    native = dtype == "bfloat16" and cpu_supports_bf16()
    assert roof["roofline_dtype"] == ("bfloat16" if native else "float32")
    assert roof["roofline_gflops"] == roof["bf16_gflops" if native else "fp32_gflops"]
    assert 0 < roof["fraction_of_roofline"] < 1.5
    # The run is also set against that rate measured just before it.
    [rate] = roof["per_run_roofline_gflops"]
    [paired] = roof["per_run_fraction"]
    assert rate > 0 and roof["median_paired_fraction"] == paired
    assert paired == pytest.approx(roof["workload_flops"] / kestrel["run_wall_s"][0] / 1e9 / rate)
    # The memory side: bf16 or float32 weights and cache (30 layers x K and V x 3 heads x 64 values).
    size = 4 if dtype == "float32" else 2
    assert roof["weight_bytes"] == size * (roof["non_embedding_params"] + roof["output_head_params"])
    assert roof["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * size
    assert roof["read_gb_s"] > 0 and roof["decode_bytes"] > 0
    assert roof["roofline_wall_s"] == pytest.approx(max(roof["limit_wall_s"], roof["memory_floor_s"]))
    assert roof["max_fraction_of_roofline"] == pytest.approx(roof["limit_wall_s"] / roof["roofline_wall_s"])
    assert 0 < roof["max_fraction_of_roofline"] <= 1
    # (Loose: on so small a workload the weights can come from the last-level cache, faster than
    # the streaming read rate the floor assumes.)
    assert 0 < roof["fraction_of_full_roofline"] < 3
    text = (tmp_path / "BENCHMARKS.md").read_text()
    short = "bf16" if native else "fp32"
    assert "offline throughput" in text and f"of the {short} roofline" in text
    assert f"against the {short} rate measured just before it" in text
    assert "streaming read rate measured in this run" in text


def test_roofline_of_a_bf16_model_is_the_float32_rate_without_bf16_instructions():
    """Where the CPU has no bf16 instructions a bf16 model's products run as float32 FMAs (linear_bf16),
    so its runs are set against the float32 matmul rate, not torch's emulated bf16 GEMM."""
    from kestrel.bench.roofline import roofline_dtype
    assert roofline_dtype("bfloat16", native_bf16=True) == "bfloat16"
    assert roofline_dtype("bfloat16", native_bf16=False) == "float32"
    assert roofline_dtype("float32", native_bf16=True) == roofline_dtype("float32", native_bf16=False) == "float32"


def test_roofline_line_says_when_the_memory_floor_caps_the_compute_target():
    from kestrel.bench.throughput_report import _roofline_line
    roof = {"threads": 2, "bf16_gflops": 2000.0, "fp32_gflops": 400.0, "shapes": [(960, 576)], "copy_gb_s": 13.0,
            "workload_flops": 6.5e12, "non_embedding_params": 106e6, "output_head_params": 28e6,
            "kestrel_gflops": 500.0, "fraction_of_roofline": 0.25, "roofline_dtype": "bfloat16",
            "limit_wall_s": 3.25, "decode_bytes": 150e9, "read_gb_s": 25.0, "memory_floor_s": 6.0,
            "roofline_wall_s": 6.0, "fraction_of_full_roofline": 0.46, "max_fraction_of_roofline": 3.25 / 6.0}
    report = {"roofline": roof, "results": [{"name": "kestrel"}]}
    assert "caps any engine that decodes one token a step at 54% of the bf16 roofline" in _roofline_line(report)
    compute_bound = {**roof, "memory_floor_s": 2.0, "roofline_wall_s": 3.25, "max_fraction_of_roofline": 1.0}
    assert "caps any engine" not in _roofline_line({**report, "roofline": compute_bound})


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_bench_throughput_w4_compares_prefix_caching(tmp_path):
    # No --no-roofline: W4 never reports a roofline fraction (its cached run skips the FLOPs W1 counts).
    result = run_kestrel("bench", "throughput", "--workload", "W4", "--num-prompts", "8", "--runs", "1",
                         "--output-json", "w4.json", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "w4.json").read_text())
    on, off = report["results"]
    assert report["workload"]["id"] == "W4 (reduced)" and report["roofline"] is None
    assert on["name"].endswith("on") and off["name"].endswith("off")
    assert on["input_tokens"] == 8 * (512 + 32) and on["output_tokens"] == 8 * 32
    # The shared prefix is computed once with caching, 64 times without.
    assert on["mean_ttft_s"] < off["mean_ttft_s"]


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT_S)
def test_chat_answers_a_line_and_exits_on_eof():
    result = run_kestrel("chat", "--max-tokens", "16", "--dtype", "float32",
                         stdin="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("> ")
    reply = result.stdout.split("> ")[1].strip()
    assert "Paris" in reply
