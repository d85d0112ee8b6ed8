"""Which build of the CPU kernels a machine takes, by its CPU flags (no build here)."""

import pytest

import kestrel.ops as ops
from kestrel import platform
from kestrel.ops import build


@pytest.mark.parametrize("flags, isa", [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "avx512"),
    ({"avx2", "fma", "avx512f"}, "avx512"),
    ({"avx2", "fma"}, "avx2"),   # most laptops, AMD Zen 1-3
    ({"avx2"}, None),            # AVX2 without FMA: the PyTorch path
    ({"sse4_2", "avx"}, None),
    (set(), None),               # no /proc/cpuinfo (another OS)
])
def test_the_kernel_build_follows_the_cpu_flags(monkeypatch, flags, isa):
    monkeypatch.delenv("KESTREL_CPU_KERNELS", raising=False)
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(flags))
    assert ops.cpu_kernels_isa() == isa


@pytest.mark.parametrize("flags, isa",
                         [({"avx2", "fma", "avx512f"}, "avx2"), ({"avx2", "fma"}, "avx2"), ({"avx2"}, None)])
def test_kestrel_cpu_kernels_avx2_takes_the_avx2_build(monkeypatch, flags, isa):
    monkeypatch.setenv("KESTREL_CPU_KERNELS", "avx2")
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset(flags))
    assert ops.cpu_kernels_isa() == isa


def test_the_two_builds_of_the_sources_live_apart(monkeypatch):
    """Their build keys differ (the flags select the vector header), so both stay in the cache."""
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    avx512, avx2 = (build.build_dir(isa) for isa in ("avx512", "avx2"))
    assert avx512 != avx2 and avx512.parent == avx2.parent
    assert "-DKESTREL_VEC_AVX2" in build.ISA_CFLAGS["avx2"] and "-march=native" not in build.ISA_CFLAGS["avx2"]


def test_every_source_is_one_family_under_the_size_limit():
    """Each op family is a source of its own, none over ~1,200 lines, and every source and header
    that a build compiles is in csrc/ (so in the build key)."""
    for name in build.SOURCES:
        assert len((build.CSRC / name).read_text().splitlines()) <= 1200, name
    compiled = set(build.build_inputs())
    assert set(build.SOURCES) <= compiled
    assert {"isa.h", "kernels.h", "vec_avx512.h", "vec_avx2.h"} <= compiled
    assert {p.name for p in build.CSRC.iterdir()} == compiled, "a file of csrc/ that no source includes"


def test_the_build_key_follows_the_headers_a_source_includes(tmp_path, monkeypatch):
    for path in build.CSRC.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "CSRC", tmp_path)
    before = build.build_key("avx2")
    assert build.build_key("avx2") == before
    (tmp_path / "unrelated.h").write_text("#pragma once\n")   # included by no source: no rebuild
    assert build.build_key("avx2") == before
    with open(tmp_path / "vec_common.h", "a") as header:       # included through isa.h by every source
        header.write("// changed\n")
    assert build.build_key("avx2") != before


@pytest.mark.parametrize("has_bf16, label", [(True, "llama-server:bf16"), (False, "llama-server:f32")])
def test_a_bare_llama_server_peer_runs_kestrels_precision(monkeypatch, has_bf16, label):
    from kestrel.bench.launch import peer_label
    monkeypatch.setattr(ops, "cpu_prefers_bf16", lambda: has_bf16)
    assert peer_label("llama-server") == label
    assert peer_label("llama-server:q4_1") == "llama-server:q4_1" and peer_label("kestrel") == "kestrel"
    # Beside a Kestrel whose dtype is given, a bare llama-server runs in that precision.
    assert peer_label("llama-server", "bfloat16") == "llama-server:bf16"
    assert peer_label("llama-server", "float32") == "llama-server:f32"
    assert peer_label("llama-server", "auto") == label
    assert peer_label("llama-server:q8_0", "bfloat16") == "llama-server:q8_0"


def test_kestrels_benchmark_weights_and_the_bare_peer_beside_them(monkeypatch):
    """bf16 (the workloads' definition) dequantizes a GGUF model's blocks, --quantization none, unless
    the flags name a quantization; native keeps them, and a bare llama-server then reads the same file."""
    from kestrel.bench.launch import bare_peer, kestrel_weights_flags, named_quantization
    monkeypatch.setattr(ops, "cpu_prefers_bf16", lambda: True)
    assert kestrel_weights_flags("bf16", ["--dtype", "bfloat16"]) == ["--dtype", "bfloat16", "--quantization", "none"]
    assert kestrel_weights_flags("bf16", ["--quantization=int8"]) == ["--quantization=int8"]
    assert kestrel_weights_flags("native", []) == []
    assert named_quantization(["--dtype", "bfloat16"]) is None
    assert named_quantization(["--quantization", "int8", "--dtype", "bfloat16"]) == "int8"
    assert named_quantization(["--quantization=none", "--quantization", "int8"]) == "int8"   # the last one counts
    assert bare_peer("llama-server", None, "bf16") == "llama-server:bf16"
    assert bare_peer("llama-server", None, "native") == "llama-server:native"
    assert bare_peer("llama-server:q8_0", None, "native") == "llama-server:q8_0"
    assert bare_peer("kestrel", None, "native") == "kestrel"


def test_the_dtype_among_kestrels_flags():
    from kestrel.bench.launch import dtype_in_flags
    assert dtype_in_flags([]) is None and dtype_in_flags(["--async-scheduling"]) is None
    assert dtype_in_flags(["--dtype", "bfloat16", "--enforce-eager"]) == "bfloat16"
    assert dtype_in_flags(["--dtype=float32"]) == "float32"
    assert dtype_in_flags(["--dtype", "float32", "--dtype", "bf16"]) == "bf16"  # the last one counts, as argparse


@pytest.mark.parametrize("native_bf16, avx2_build, prefers", [
    (True, False, True),    # AVX512-BF16 or AMX
    (False, True, True),    # the AVX2 build's linear_bf16 (AVX2-only CPUs)
    (False, False, False),  # AVX-512 without bf16 (not measured there), or no kernels: float32
])
def test_cpu_prefers_bf16_where_it_computes_faster(monkeypatch, native_bf16, avx2_build, prefers):
    import kestrel.config
    monkeypatch.setattr(kestrel.config, "cpu_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(ops, "_avx2_build_loaded", lambda: avx2_build)
    assert ops.cpu_prefers_bf16() is prefers


@pytest.mark.parametrize("prefers, expected", [(True, "bfloat16"), (False, "float32")])
def test_dtype_auto_on_a_cpu_follows_what_it_prefers(prefers, expected):
    import torch

    from kestrel.config import resolve_dtype
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, lambda: prefers) == getattr(torch, expected)

    def never() -> bool:
        raise AssertionError("an explicit dtype asks nothing of the CPU")
    assert resolve_dtype("float32", cpu, never) == torch.float32
    assert resolve_dtype("bf16", cpu, never) == torch.bfloat16
