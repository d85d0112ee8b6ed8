"""Ray and OpenTelemetry are optional extras: the engine starts without them, and a flag that needs
one that is missing is a clear error before any process starts."""

import importlib.util
import subprocess
import sys

import pytest

from kestrel.engine.arg_utils import EngineArgs, check_optional_packages


@pytest.mark.parametrize("flags, module, package", [
    ({"distributed_executor_backend": "ray"}, "ray", "ray"),
    ({"otlp_traces_endpoint": "http://127.0.0.1:4318"}, "opentelemetry.sdk", "opentelemetry-sdk")])
def test_a_flag_whose_package_is_missing_says_what_to_install(monkeypatch, flags, module, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(ValueError, match=rf"needs the package {package}.*pip install 'kestrel\["):
        check_optional_packages(EngineArgs(model="m", **flags))
    check_optional_packages(EngineArgs(model="m"))   # without the flag, nothing is asked of it


# A child process in which ray and OpenTelemetry's SDK and exporter cannot be imported, as where the
# extras are not installed (opentelemetry-api itself comes with fastapi).
HIDDEN = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray" or name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
"""


def test_the_engine_starts_without_ray_or_opentelemetry():
    """The engine, the server and the CLI import, and an offline engine generates, without them."""
    code = HIDDEN + (
        "import kestrel.entrypoints.cli, kestrel.entrypoints.openai.api_server, kestrel.engine.async_llm\n"
        "from tests.support.parity import save_tiny_llama\n"
        "import tempfile\n"
        "from kestrel import LLM, SamplingParams\n"
        "folder = tempfile.mkdtemp()\n"
        "save_tiny_llama(folder)\n"
        "out = LLM(model=folder, dtype='float32').generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
