"""tools/simde_avx512 only (run.sh puts this folder on PYTHONPATH, so that the engine's own processes
load it too): where KESTREL_SIMDE_MODULES names the emulated builds (`source=module path`, separated
by `:`), kestrel.ops reads this CPU's flags plus the AVX-512 features of the CPU stood in for
(KESTREL_SIMDE_CPU, see cpus.py; never AMX) and loads those modules in place of its own builds
(cpu_kernels.cpp's: its AVX-512 one)."""
import os

if os.environ.get("KESTREL_SIMDE_MODULES"):
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    import kestrel.ops as ops

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cpus import flags, selected

    _flags = ops._cpu_flags() | flags(selected())
    ops._cpu_flags = lambda: _flags

    _modules = dict(item.split("=", 1) for item in os.environ["KESTREL_SIMDE_MODULES"].split(":"))

    def _load(source_name, isa=None):
        if source_name not in _modules or isa not in (None, "avx512"):
            raise RuntimeError(f"{source_name} ({isa}) is not emulated")
        path = _modules[source_name]
        name = os.path.basename(path).split(".")[0]
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
        loader.exec_module(module)
        return module

    ops.load_cpu_extension = _load
