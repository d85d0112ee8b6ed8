"""tools/simde_avx512 only (run.sh puts this folder on PYTHONPATH, so that the engine's own processes
load it too): where KESTREL_SIMDE_MODULE names the emulated AVX-512 extension (build.py's output),
kestrel.platform reports this CPU's flags plus the AVX-512 features of the CPU stood in for
(KESTREL_SIMDE_CPU, see cpus.py; never AMX) and kestrel.ops loads that module as its AVX-512 build."""
import os

if os.environ.get("KESTREL_SIMDE_MODULE"):
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    from kestrel import platform
    from kestrel.ops import build

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from cpus import flags, selected

    _flags = platform.cpu_flags() | flags(selected())
    platform.cpu_flags = lambda: _flags

    def _load(isa):
        if isa != "avx512":
            raise build.KernelBuildError(f"the {isa} build is not emulated")
        path = os.environ["KESTREL_SIMDE_MODULE"]
        name = os.path.basename(path).split(".")[0]
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
        loader.exec_module(module)
        return module

    build.load_extension = _load
