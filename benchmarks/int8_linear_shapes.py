"""--quantization int8's matmul (the one select_int8_matmul picks) against the bf16 paths, torch's
F.linear and cpu_gemv's linear_bf16_avx512 (1..128 rows), at the default model's projection shapes, one
projection at a time. Each is called over 30 copies of its weights in turn, as a decode step reads
30 layers' weights once each (from memory, not cache); the three are interleaved call by call, and
each figure is the median over --calls calls of the time per layer, in µs.

    python benchmarks/int8_linear_shapes.py [--rows 1 8 64] [--calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kestrel.model import quantization as Q
from kestrel.ops import cpu_gemv

LAYERS = 30
SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}


def _medians_us(fns: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    for _ in range(3):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) / LAYERS * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    int8_matmul = Q.select_int8_matmul(torch.device("cpu"), torch.bfloat16)
    gemv = cpu_gemv()
    print(f"threads {torch.get_num_threads()}, int8 matmul: {getattr(int8_matmul, '__qualname__', int8_matmul)}")
    print("| shape | rows | F.linear bf16 | linear_bf16_avx512 | int8 | fastest bf16 / int8 |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k).mul_(0.05).bfloat16() for _ in range(LAYERS)]
        quantized = [Q.quantize_weight(w.float()) for w in weights]
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            fns: dict[str, Callable[[], object]] = {
                "linear": lambda x=x, ws=weights: [F.linear(x, w) for w in ws],
                "int8": lambda x=x, qs=quantized: [int8_matmul(x, q, s) for q, s in qs]}
            if gemv is not None and rows <= 128:
                fns["small"] = lambda x=x, ws=weights: [gemv.linear_bf16_avx512(x, w) for w in ws]
            med = _medians_us(fns, args.calls)
            best = min(t for key, t in med.items() if key != "int8")
            small = f"{med['small']:.1f}" if "small" in med else "—"
            print(f"| {name} | {rows} | {med['linear']:.1f} | {small} | {med['int8']:.1f} "
                  f"| {best / med['int8']:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
