"""kestrel.bench.peers: weights in another precision, the llama-server binary, the server context
managers and the memory sampler. No test needs a real llama-server (a fake one stands in)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, LlamaFileType
from gguf.quants import dequantize

from kestrel.bench import peers
from kestrel.bench.peers import (
    KestrelServer,
    LlamaServer,
    RssSampler,
    gguf_in_precision,
    llama_server_binary,
    rss_of_tree,
)
from kestrel.model.gguf_loader import iter_gguf_weights
from kestrel.model.loader import default_model_path

FILE_TYPES = {"bf16": LlamaFileType.MOSTLY_BF16, "f32": LlamaFileType.ALL_F32, "q8_0": LlamaFileType.MOSTLY_Q8_0}
TARGET_TYPES = {"bf16": QT.BF16, "f32": QT.F32, "q8_0": QT.Q8_0}


# ---- gguf_in_precision ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def source() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def source_reader(source) -> GGUFReader:
    return GGUFReader(source)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("peers-cache")
    return {p: gguf_in_precision(source, p, cache_dir=cache) for p in ("bf16", "f32", "q8_0")}


def _metadata(reader: GGUFReader) -> list[tuple[str, list, object]]:
    return [(k, f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")]


def _bf16_round(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(values, dtype=np.float32)).bfloat16().float().numpy()


@pytest.mark.parametrize("precision", ["bf16", "f32", "q8_0"])
def test_converted_file_keeps_metadata_and_tensors(precision, converted, source, source_reader):
    out_path = converted[precision]
    assert out_path.suffix == ".gguf" and out_path.parent != source.parent
    out = GGUFReader(out_path)

    # Metadata: every key, in order, with its type and value; only general.file_type differs.
    src_meta, out_meta = _metadata(source_reader), _metadata(out)
    assert [k for k, _, _ in out_meta] == [k for k, _, _ in src_meta]
    for (key, src_types, src_value), (_, out_types, out_value) in zip(src_meta, out_meta):
        assert out_types == src_types, key
        if key == "general.file_type":
            assert src_value == LlamaFileType.MOSTLY_Q4_1 and out_value == FILE_TYPES[precision]
        else:
            assert out_value == src_value, key
    assert out.alignment == source_reader.alignment

    # Tensors: same names, order and GGUF shapes; 1-D in f32, 2-D in the target type.
    assert [t.name for t in out.tensors] == [t.name for t in source_reader.tensors]
    for src_t, out_t in zip(source_reader.tensors, out.tensors):
        assert out_t.shape.tolist() == src_t.shape.tolist(), src_t.name
        expected_type = QT.F32 if len(src_t.shape) == 1 else TARGET_TYPES[precision]
        assert out_t.tensor_type == expected_type, src_t.name
        src_values = dequantize(src_t.data, src_t.tensor_type)
        out_values = dequantize(out_t.data, out_t.tensor_type)
        assert out_values.shape == src_values.shape
        if out_t.tensor_type == QT.BF16:
            # bf16 rounding (to nearest even, as torch does it): off by at most half a bf16 ulp.
            assert np.array_equal(out_values, _bf16_round(src_values)), src_t.name
            assert np.all(np.abs(out_values - src_values) <= np.abs(src_values) * 2.0 ** -8), src_t.name
        elif out_t.tensor_type == QT.Q8_0:
            # blocks of 32 along a row, scale max|x| / 127 stored in f16: off by half a step, and the
            # scale's rounding (2^-11 relative) over up to 127 steps.
            blocks = src_values.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            err = np.abs(out_values.reshape(-1, 32) - blocks)
            assert np.all(err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-12), src_t.name
        else:
            assert np.array_equal(out_values, src_values), src_t.name


def test_converted_file_is_cached(converted, source):
    folder = converted["bf16"].parent
    before = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert sorted(p.name for p in before) == sorted(p.name for p in converted.values())  # no temp files left
    for precision, path in converted.items():
        assert gguf_in_precision(source, precision, cache_dir=folder) == path
        assert gguf_in_precision(source, precision.upper(), cache_dir=folder) == path
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_native_precisions_return_the_source(source, tmp_path):
    assert gguf_in_precision(source, "q4_1", cache_dir=tmp_path) == source
    assert gguf_in_precision(source, "native", cache_dir=tmp_path) == source
    with pytest.raises(ValueError, match="unknown precision"):
        gguf_in_precision(source, "q5_k", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_f32_file_loads_to_the_same_weights(converted, source):
    """Kestrel's loader (which un-permutes llama's q/k rows) sees exactly the source's weights."""
    for (name, expected), (out_name, got) in zip(iter_gguf_weights(str(source)),
                                                 iter_gguf_weights(str(converted["f32"])), strict=True):
        assert out_name == name
        assert torch.equal(got, expected), name


@pytest.mark.slow
def test_bf16_file_generates_like_the_source(converted, source):
    from kestrel import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"
    outputs = []
    for model in (source, converted["bf16"]):
        # The tokenizer of the source: the same vocabulary, and its conversion is already cached.
        llm = LLM(model=str(model), tokenizer=str(source), dtype="float32", max_model_len=64,
                  kv_cache_memory=16 << 20, max_num_batched_tokens=64, max_num_seqs=4)
        outputs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
    assert len(outputs[0]) == 8
    assert outputs[1] == outputs[0]


# ---- llama_server_binary -------------------------------------------------------------------------

def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_binary_from_env(tmp_path, monkeypatch):
    binary = _executable(tmp_path / "llama-server", "#!/bin/sh\n")
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(binary))
    monkeypatch.setenv(peers.PEERS_SCRIPT_ENV, str(tmp_path / "never-run.sh"))
    assert llama_server_binary() == binary
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="not an executable"):
        llama_server_binary()


def test_binary_from_build_script(tmp_path, monkeypatch):
    binary = _executable(tmp_path / "llama-server", "#!/bin/sh\n")
    script = tmp_path / "build.sh"
    script.write_text(f"echo building >&2\necho some output\necho {binary}\n")
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv(peers.PEERS_SCRIPT_ENV, str(script))
    assert llama_server_binary() == binary

    script.write_text("echo /nonexistent/llama-server\n")
    with pytest.raises(RuntimeError, match="not an executable file"):
        llama_server_binary()
    script.write_text("exit 3\n")
    with pytest.raises(RuntimeError, match="exit status 3"):
        llama_server_binary()
    monkeypatch.setenv(peers.PEERS_SCRIPT_ENV, str(tmp_path / "missing.sh"))
    with pytest.raises(RuntimeError) as err:
        llama_server_binary()
    assert peers.LLAMA_SERVER_ENV in str(err.value) and peers.PEERS_SCRIPT_ENV in str(err.value)


# ---- LlamaServer with a stand-in binary ---------------------------------------------------------

FAKE_LLAMA_SERVER = """\
#!{python}
import http.server, json, sys, time
args = sys.argv[1:]
if args == ["--help"]:
    print("-cb, --cont-batching  whether to enable continuous batching")
    print("-fa, --flash-attn [on|off|auto]  set Flash Attention use ('on', 'off', or 'auto', default: 'auto')")
    sys.exit(0)
if args == ["--version"]:
    print("version: 6810 (abc1234)", file=sys.stderr)
    print("built with cc for x86_64", file=sys.stderr)
    sys.exit(0)
if "--fail" in args:
    print("error: cannot load the model", flush=True)
    sys.exit(1)
port = int(args[args.index("--port") + 1])
time.sleep(0.5)  # a server that is not listening at once

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"path": self.path, "argv": args}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass

print("server listening", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def fake_llama(tmp_path) -> Path:
    peers._llama_help_text.cache_clear()
    peers.llama_server_version.cache_clear()
    return _executable(tmp_path / "llama-server", FAKE_LLAMA_SERVER.format(python=sys.executable))


def test_llama_server_command_label_and_stop(fake_llama, converted):
    server = LlamaServer(converted["bf16"], parallel=4, ctx_per_slot=512, threads=2, extra_args=["--foo"],
                         binary=fake_llama)
    assert server.label == "llama.cpp b6810 bf16 (-np 4 -fa on)" and server.version == "6810 (abc1234)"
    with server:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        with urllib.request.urlopen(f"{server.base_url}/models") as resp:
            argv = json.load(resp)["argv"]
        assert argv == ["-m", str(converted["bf16"]), "--host", "127.0.0.1", "--port", str(server.port),
                        "-np", "4", "-c", "2048", "-t", "2", "-tb", "2", "--cache-ram", "0", "--no-webui",
                        "--cont-batching", "-fa", "on", "--foo"]
        pid = server.pid
        log_path = server.log_path
        assert "server listening" in server.log_tail()
    assert server.proc.returncode == -15  # SIGTERM
    assert not Path(f"/proc/{pid}").exists() and not log_path.exists()


def test_flash_attention_flag_follows_the_binary():
    assert peers.flash_attention_args("-fa,    --flash-attn [on|off|auto] set Flash Attention use") == ["-fa", "on"]
    assert peers.flash_attention_args("-fa,    --flash-attn FA   set Flash Attention use") == ["-fa", "on"]
    assert peers.flash_attention_args("-fa,    --flash-attn   enable Flash Attention (default: disabled)") == ["-fa"]
    assert peers.flash_attention_args("-cb, --cont-batching") == []


def test_llama_server_failure_shows_the_log(fake_llama, source):
    server = LlamaServer(source, parallel=1, ctx_per_slot=64, binary=fake_llama, extra_args=["--fail"])
    assert server.label == "llama.cpp b6810 q4_1 (-np 1 -fa on)"
    with pytest.raises(RuntimeError, match="(?s)exited with status 1.*cannot load the model"):
        with server:
            pass
    assert server.log_path.exists()  # kept for a look
    server.log_path.unlink()


# ---- memory -------------------------------------------------------------------------------------

def test_rss_sampler_counts_children():
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; b = b'x' * (96 << 20); print('ready', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        own = rss_of_tree(child.pid)
        assert own > 96 << 20
        with RssSampler(os.getpid(), interval_s=0.05) as sampler:
            time.sleep(0.2)
        assert sampler.samples >= 3
        assert sampler.peak >= own + psutil_rss(os.getpid()) * 0.9
    finally:
        child.kill()
        child.wait()
    assert rss_of_tree(child.pid) == 0


def psutil_rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


# ---- KestrelServer ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kestrel_server_starts_answers_and_stops():
    with KestrelServer(["--max-model-len", "256", "--kv-cache-memory", "16MiB"]) as server:
        assert server.label == "kestrel"
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        with urllib.request.urlopen(f"{server.base_url}/models", timeout=30) as resp:
            models = json.load(resp)
        assert models["data"] and models["data"][0]["id"]
        with RssSampler(server.pid) as sampler:
            time.sleep(0.3)
        assert sampler.peak > 50 << 20  # the server and its engine-core process hold the model
        pid = server.pid
    assert server.proc.returncode == 0, server.log_tail()
    assert not Path(f"/proc/{pid}").exists()


def test_llama_slots_take_the_swept_best_within_the_requests(monkeypatch):
    from kestrel.bench import launch
    monkeypatch.delenv(launch.LLAMA_NP_ENV, raising=False)
    assert launch.llama_slots(64) == launch.LLAMA_BEST_NP
    assert launch.llama_slots(8) == min(8, launch.LLAMA_BEST_NP)
    monkeypatch.setenv(launch.LLAMA_NP_ENV, "32")
    assert launch.llama_slots(64) == 32 and launch.llama_slots(1) == 1
    monkeypatch.setenv(launch.LLAMA_NP_ENV, "0")
    with pytest.raises(ValueError, match=launch.LLAMA_NP_ENV):
        launch.llama_slots(64)


def test_built_llama_tools_are_found_without_building(tmp_path, monkeypatch):
    bin_dir = tmp_path / "cache" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    quantize = _executable(bin_dir / "llama-quantize", "#!/bin/sh\n")
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    monkeypatch.setenv(peers.PEER_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(peers.PEERS_SCRIPT_ENV, str(tmp_path / "never-run.sh"))
    assert peers.built_llama_tool("llama-quantize") == quantize
    assert peers.built_llama_tool("llama-server") is None  # not built, and nothing is built here
    server = _executable(tmp_path / "llama-server", "#!/bin/sh\n")
    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(server))
    assert peers.built_llama_tool("llama-server") == server
    assert peers.built_llama_tool("llama-quantize") is None  # not beside $KESTREL_LLAMA_SERVER
    with pytest.raises(RuntimeError, match="llama-quantize not found"):
        peers.llama_quantize_binary()
    _executable(tmp_path / "llama-quantize", "#!/bin/sh\n")
    assert peers.llama_quantize_binary() == tmp_path / "llama-quantize"
    monkeypatch.setenv(peers.LLAMA_QUANTIZE_ENV, str(quantize))
    assert peers.llama_quantize_binary() == quantize


def test_the_transformers_peer_runs_kestrels_dtype_or_the_one_named():
    from kestrel.bench.throughput import check_options, transformers_dtype
    from kestrel.entrypoints.cli import build_parser, engine_kwargs
    assert transformers_dtype("transformers", "bfloat16") == "bfloat16"
    assert transformers_dtype("transformers:float32", "bfloat16") == "float32"
    assert transformers_dtype("transformers:bfloat16", "float32") == "bfloat16"
    args = build_parser().parse_args(["bench", "throughput", "--peer", "transformers:float32",
                                      "--peer", "transformers"])
    check_options(args, engine_kwargs(args))  # not taken for a server
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--peer", "transformers:float16"])
