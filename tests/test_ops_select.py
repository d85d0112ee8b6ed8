"""Which source of the CPU kernels a machine builds, by its CPU flags (no build here)."""

import pytest

import kestrel.ops as ops


@pytest.mark.parametrize("flags, source", [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, "cpu_kernels.cpp"),
    ({"avx2", "fma", "avx512f"}, "cpu_kernels.cpp"),
    ({"avx2", "fma"}, "cpu_kernels_avx2.cpp"),   # most laptops, AMD Zen 1-3
    ({"avx2"}, None),                            # AVX2 without FMA: the PyTorch path
    ({"sse4_2", "avx"}, None),
    (set(), None),                               # no /proc/cpuinfo (another OS)
])
def test_the_kernel_source_follows_the_cpu_flags(monkeypatch, flags, source):
    monkeypatch.setattr(ops, "_cpu_flags", lambda: frozenset(flags))
    assert ops.cpu_kernels_source() == source


@pytest.mark.parametrize("has_bf16, label", [(True, "llama-server:bf16"), (False, "llama-server:f32")])
def test_a_bare_llama_server_peer_runs_kestrels_precision(monkeypatch, has_bf16, label):
    import kestrel.config
    from kestrel.bench.launch import peer_label
    monkeypatch.setattr(kestrel.config, "cpu_supports_bf16", lambda: has_bf16)
    assert peer_label("llama-server") == label
    assert peer_label("llama-server:q4_1") == "llama-server:q4_1" and peer_label("kestrel") == "kestrel"
