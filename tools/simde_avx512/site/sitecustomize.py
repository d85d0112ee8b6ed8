"""tools/simde_avx512 only (run.sh puts this folder on PYTHONPATH, so that the engine's own processes
load it too): where KESTREL_SIMDE_SO names the emulated build, kestrel.ops reads this CPU's flags plus
AVX-512 (F, BW, VL, DQ, CD, BF16, VNNI; not AMX) and loads that module as cpu_kernels.cpp's AVX-512
build. The other kernel sources (cpu_gemv.cpp, cpu_prefill.cpp) are not emulated: they load as None."""
import os

if os.environ.get("KESTREL_SIMDE_SO"):
    import importlib.machinery
    import importlib.util

    import kestrel.ops as ops

    _flags = ops._cpu_flags() | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16",
                                 "avx512_vnni"}
    ops._cpu_flags = lambda: _flags

    def _load(source_name, isa=None):
        if source_name == "cpu_kernels.cpp" and isa == "avx512":
            path = os.environ["KESTREL_SIMDE_SO"]
            loader = importlib.machinery.ExtensionFileLoader("kestrel_cpu_kernels_simde", path)
            module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(
                "kestrel_cpu_kernels_simde", path, loader=loader))
            loader.exec_module(module)
            return module
        raise RuntimeError(f"{source_name} ({isa}) is not emulated")

    ops.load_cpu_extension = _load
