"""Micro-benchmark of the AMX prefill-attention kernel against SDPA, one layer at the default
model's shapes: `python -m kestrel.bench.kernels [--lengths 64 128 ...] [--heads 9 --kv-heads 3
--head-dim 64]`. Prints a Markdown table (medians of --calls calls, after a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def _median_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def prefill_attention_table(lengths: list[int], heads: int, kv_heads: int, head_dim: int, calls: int) -> str:
    import torch
    import torch.nn.functional as F

    from kestrel.ops import cpu_prefill

    kernels = cpu_prefill()
    if kernels is None or not kernels.usable():
        raise SystemExit("the AMX prefill kernel is not available on this machine")
    scale = head_dim ** -0.5
    rows = ["| prompt tokens | SDPA | AMX kernel | speed-up |", "|---|---|---|---|"]
    for n in lengths:
        qkv = torch.randn(n, heads + 2 * kv_heads, head_dim).bfloat16()
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        sdpa = _median_us(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                  enable_gqa=True), calls)
        amx = _median_us(lambda: kernels.prefill_attention(q, k, v, scale), calls)
        flops = n * n / 2 * heads * head_dim * 4  # causal: QK^T and PV over half the square
        rows.append(f"| {n} | {sdpa:.0f} µs ({flops / sdpa / 1e3:.0f} GFLOP/s) | {amx:.0f} µs "
                    f"({flops / amx / 1e3:.0f} GFLOP/s) | {sdpa / amx:.2f}× |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 288, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    print(prefill_attention_table(args.lengths, args.heads, args.kv_heads, args.head_dim, args.calls))


if __name__ == "__main__":
    main()
