"""`python -m kestrel.ops [--all-isas]`: build the CPU kernels this machine runs, now rather than in
the first request or test that needs them (about two minutes on 2 cores; a built one loads at once).

`--all-isas` also builds the AVX2 extension on an AVX-512 CPU, the build the test suite runs in a
child process (`make test` asks for it). A build that fails on a CPU that can run it exits non-zero
with the compiler's message; a machine without AVX2 has no kernels to build (the engine runs its
PyTorch path there) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from kestrel.ops.build import KernelBuildError, isa_supported, load_extension


def _build(isa: str) -> bool:
    start = time.perf_counter()
    try:
        module = load_extension(isa)
    except (KernelBuildError, TimeoutError) as exc:
        print(f"kestrel kernels: the {isa} build FAILED:\n{exc}", file=sys.stderr, flush=True)
        return False
    extras = [name for name in ("avx512_bf16", "int8_linear") if getattr(module, name)]
    print(f"kestrel kernels: {isa} ready ({', '.join(extras) or 'vector kernels only'}; "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kestrel.ops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--all-isas", action="store_true", help="also the AVX2 build on an AVX-512 CPU")
    args = parser.parse_args()
    isas = [isa for isa in ("avx512", "avx2") if isa_supported(isa)]
    if not args.all_isas:
        isas = isas[:1]
    if not isas:
        print("kestrel kernels: this CPU has neither AVX-512 nor AVX2; the engine runs its PyTorch path")
        return
    ok = True
    for isa in isas:
        # Each in a process of its own: two builds of the same sources cannot share a process.
        if isa == isas[0]:
            ok &= _build(isa)
        else:
            child = subprocess.run([sys.executable, "-c", f"import sys; from kestrel.ops.__main__ import _build; "
                                    f"sys.exit(0 if _build({isa!r}) else 1)"], env=os.environ.copy(), check=False)
            ok &= child.returncode == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
