"""The shared leaf modules that hold the environment and the platform: every KESTREL_* variable the
product reads is declared in kestrel/envs.py and read nowhere else, live at each access; the CPU's
flags are read from /proc/cpuinfo once, by kestrel/platform.py alone."""

import re
from pathlib import Path

import pytest

from kestrel import envs, platform

PRODUCT = Path(envs.__file__).parent
# A read of a KESTREL_* variable from the environment, in any of the forms Python offers.
ENV_READ = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*["'](KESTREL_\w+)["']""")


def _product_sources():
    return [p for p in PRODUCT.rglob("*.py") if p.name != "envs.py"]


def test_no_product_module_reads_a_kestrel_variable_itself():
    readers = {str(p.relative_to(PRODUCT)): ENV_READ.findall(p.read_text()) for p in _product_sources()}
    assert {name: found for name, found in readers.items() if found} == {}


def test_every_variable_named_in_the_product_is_declared():
    named = set()
    for path in _product_sources():
        named |= set(re.findall(r"\benvs\.(KESTREL_\w+)", path.read_text()))
    assert named, "the pattern finds the reads"
    assert named <= set(envs.VARIABLES), named - set(envs.VARIABLES)
    for variable in envs.VARIABLES.values():
        assert variable.meaning and variable.type, variable.name
    assert envs.VARIABLES["KESTREL_STRICT_KERNELS"].test_hook


def test_a_variable_is_read_at_each_access(monkeypatch):
    monkeypatch.delenv("KESTREL_DISABLE_CPU_KERNELS", raising=False)
    assert envs.KESTREL_DISABLE_CPU_KERNELS is False
    monkeypatch.setenv("KESTREL_DISABLE_CPU_KERNELS", "1")
    assert envs.KESTREL_DISABLE_CPU_KERNELS is True
    monkeypatch.setenv("KESTREL_CPU_KERNELS", "AVX2")
    assert envs.KESTREL_CPU_KERNELS == "avx2"
    monkeypatch.setenv("KESTREL_CPU_KERNELS", "sse")
    with pytest.raises(ValueError, match="KESTREL_CPU_KERNELS"):
        _ = envs.KESTREL_CPU_KERNELS
    with pytest.raises(AttributeError):
        _ = envs.KESTREL_NOT_A_VARIABLE


def test_the_cpu_is_probed_once_and_only_by_platform():
    platform._cpuinfo.cache_clear()
    flags = platform.cpu_flags()
    assert platform._cpuinfo.cache_info().misses == 1
    platform.has_avx2(), platform.has_avx512(), platform.has_amx_tile(), platform.cpu_model_name()
    assert platform._cpuinfo.cache_info().misses == 1 and platform.cpu_flags() == flags
    others = [str(p.relative_to(PRODUCT)) for p in PRODUCT.rglob("*.py")
              if p.name != "platform.py" and "/proc/cpuinfo" in p.read_text()]
    assert others == []
