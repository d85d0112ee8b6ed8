"""On an AVX-512 CPU the kernel tests run against the AVX-512 build of cpu_kernels.cpp: the same
source on 8-lane vectors (vec_avx2.h), compiled for x86-64-v3, and the float32 decode plan (which
runs where linear_f32 is preferred, on the AVX2 build) would go untested. Here the kernel,
float32-plan, bf16 matmul (linear_bf16), portable prefill-attention, int8 KV-cache, int8 matmul
(--quantization int8: linear_int8's vpmaddubsw form, and an engine run on it) and GGUF Q8_0 matmul
(linear_gguf, and engine runs on it) and batch-invariance tests run again in a
child process with KESTREL_CPU_KERNELS=avx2, so that a server CI also checks the path most laptops
take."""

import os
import subprocess
import sys

import pytest

from kestrel.ops import _cpu_has_avx2, _cpu_has_avx512

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (_cpu_has_avx512() and _cpu_has_avx2()),
                       reason="elsewhere the AVX2 build (or none) is what the other tests already run"),
]

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(1200)  # a first build of the AVX2 source, ~100 s on 2 cores
def test_the_avx2_build_passes_its_kernel_and_plan_tests():
    env = {**os.environ, "KESTREL_CPU_KERNELS": "avx2"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         os.path.join(TESTS, "test_cpu_kernels.py"), os.path.join(TESTS, "test_decode_plan.py"),
         os.path.join(TESTS, "test_kv_int8.py"), os.path.join(TESTS, "test_quantization.py"),
         os.path.join(TESTS, "test_linear_bf16.py"), os.path.join(TESTS, "test_cpu_prefill.py"),
         os.path.join(TESTS, "test_gguf_quant.py"), os.path.join(TESTS, "test_batch_invariance.py"),
         "-k", "linear_f32 or float32_plan or native_layer_loop or decode_layers or paged_decode or rms_norm or silu"
               " or rotary or argmax or decode_attention_int8 or engine_runs_on_the_int8_cache or same_functions"
               " or cpu_int8 or engine_gives_the_same_tokens_with_the_kernel or linear_bf16 or portable or gguf"
               " or q5 or same_bits_alone_cached"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(TESTS))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # The float32 plan's and the int8 matmul's tests ran: none may skip for want of the AVX2 build.
    assert "AVX2 build" not in result.stdout, result.stdout[-4000:]
    assert " passed" in result.stdout
