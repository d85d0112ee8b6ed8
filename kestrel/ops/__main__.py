"""`python -m kestrel.ops [--all-isas]`: build the CPU kernels this machine runs, now rather than in
the first request or test that needs them (about a minute each on 2 cores; already built ones load at once).

`--all-isas` also builds cpu_kernels.cpp for AVX2 on an AVX-512 CPU, the build the test suite runs in
a child process (`make test` asks for it). A kernel that cannot be built is reported, not fatal: the
engine then takes its PyTorch path, as it would at run time.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from kestrel import ops


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kestrel.ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-isas", action="store_true", help="also the AVX2 build on an AVX-512 CPU")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    builds = [("cpu_kernels", ops.cpu_kernels), ("cpu_gemv", ops.cpu_gemv), ("cpu_prefill", ops.cpu_prefill)]
    for name, build in builds:
        start = time.perf_counter()
        kernel = build()
        if name == "cpu_kernels":
            name += f" ({ops.cpu_kernels_isa()})"
        state = "ready" if kernel is not None else "not available here (the PyTorch path is used)"
        print(f"kestrel kernels: {name} {state} ({time.perf_counter() - start:.1f} s)", flush=True)
    if args.all_isas and ops.cpu_kernels_isa() == "avx512" and ops._cpu_has_avx2():
        # In a process of its own: both builds of one source cannot be imported into one process.
        subprocess.run([sys.executable, "-m", "kestrel.ops"], env={**os.environ, "KESTREL_CPU_KERNELS": "avx2"},
                       check=False)


if __name__ == "__main__":
    main()
