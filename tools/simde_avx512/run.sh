#!/usr/bin/env bash
# Runs tests against the AVX-512 builds of kestrel/ops' kernels emulated on this AVX2 machine (README.md).
# Usage: [KESTREL_SIMDE_CPU=zen4|icelake|skylake] tools/simde_avx512/run.sh [pytest arguments]
#   (default: zen4, and the kernel and GGUF test files)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d /usr/include/simde ]; then
  [ "$(id -u)" = 0 ] || { echo "needs Debian's libsimde-dev (apt-get install libsimde-dev, as root)"; exit 1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsimde-dev >/dev/null
fi
module=$(.venv/bin/python tools/simde_avx512/build.py | tail -1)
[ $# -gt 0 ] || set -- tests/ops/test_cpu_kernels.py tests/model/test_gguf_quant.py tests/model/test_decode_plan.py \
  tests/ops/test_linear_bf16.py tests/model/test_quantization.py tests/attention/test_kv_int8.py \
  tests/worker/test_output_rows.py tests/ops/test_cpu_gemv.py tests/ops/test_cpu_prefill.py \
  tests/attention/test_attention_backends.py
KESTREL_SIMDE_MODULE="$module" PYTHONPATH="$PWD/tools/simde_avx512/site" \
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
