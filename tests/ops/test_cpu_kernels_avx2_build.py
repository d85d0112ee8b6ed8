"""On an AVX-512 CPU the kernel tests run against the AVX-512 build of the kernels: the AVX2 build, the same
sources on 8-lane vectors (vec_avx2.h), compiled for x86-64-v3, and the float32 decode plan (which
runs where linear_f32 is preferred, on the AVX2 build) would go untested. Here the kernel,
float32-plan, bf16 matmul (linear_bf16), portable prefill-attention, int8 KV-cache, int8 matmul
(--quantization int8: linear_int8's vpmaddubsw form, and an engine run on it) and GGUF Q8_0 matmul
(linear_gguf, and engine runs on it) and batch-invariance tests run again in a
child process with KESTREL_CPU_KERNELS=avx2, so that a server CI also checks the path most laptops
take."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel.platform import has_avx2, has_avx512

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (has_avx512() and has_avx2()),
                       reason="needs a CPU with AVX-512"),   # elsewhere the other tests run the AVX2 build (or none)
]

ROOT = Path(__file__).resolve().parents[2]
# Paths from the repository root (the child's working directory).
TEST_FILES = ["tests/ops/test_cpu_kernels.py", "tests/model/test_decode_plan.py", "tests/attention/test_kv_int8.py",
              "tests/model/test_quantization.py", "tests/ops/test_linear_bf16.py", "tests/ops/test_cpu_prefill.py",
              "tests/model/test_gguf_quant.py", "tests/e2e/test_batch_invariance.py"]


@pytest.mark.timeout(1200)  # a first build of the AVX2 source, ~100 s on 2 cores
def test_the_avx2_build_passes_its_kernel_and_plan_tests():
    env = {**os.environ, "KESTREL_CPU_KERNELS": "avx2"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *TEST_FILES,
         "-k", "linear_f32 or float32_plan or native_layer_loop or decode_layers or paged_decode or rms_norm or silu"
               " or gelu or rotary or argmax or decode_attention_int8 or engine_runs_on_the_int8_cache"
               " or same_functions or cpu_int8 or engine_gives_the_same_tokens_with_the_kernel or linear_bf16"
               " or portable or gguf or q5 or same_bits_alone_cached"],
        env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # The float32 plan's and the int8 matmul's tests ran: none may skip for want of the AVX2 build (or
    # of AVX2, which this CPU has).
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skips if "AVX2" in line], result.stdout[-4000:]
    assert " passed" in result.stdout
