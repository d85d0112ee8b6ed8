"""Micro-benchmarks of the CPU kernels at the default model's shapes; each prints a Markdown table
(medians of --calls calls, after a warm-up).

`python -m kestrel.bench.kernels [--lengths 64 128 ...] [--heads 9 --kv-heads 3 --head-dim 64]`: the
prefill-attention kernel (its AMX path where the CPU has one, and its AVX512-BF16 path) against SDPA,
one layer.

`python -m kestrel.bench.kernels --linear [--rows 1 8 ...]`: the four projections of one decoder
layer, bf16 (as Kestrel runs them: AMX up to 128 rows where the CPU has it, the small-batch kernel
or torch's GEMM elsewhere) against --quantization int8 (AMX-INT8 where the CPU has it, else
cpu_kernels' linear_int8 on AVX512-VNNI or AVX2), the two interleaved call by call.
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
    if kernels is None:
        raise SystemExit("the prefill-attention kernel is not available on this machine (it needs AVX512-BF16)")
    paths = (["amx"] if kernels.amx_usable() else []) + ["avx512"]
    scale = head_dim ** -0.5
    rows = ["| prompt tokens | SDPA | " + " | ".join(f"{p} kernel | speed-up" for p in paths) + " |",
            "|---|---|" + "---|---|" * len(paths)]
    for n in lengths:
        qkv = torch.randn(n, heads + 2 * kv_heads, head_dim).bfloat16()
        q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        sdpa = _median_us(lambda qh=qh, kh=kh, vh=vh: F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True), calls)
        flops = n * n / 2 * heads * head_dim * 4  # causal: QK^T and PV over half the square
        cells = [f"{n}", f"{sdpa:.0f} µs ({flops / sdpa / 1e3:.0f} GFLOP/s)"]
        for p in paths:
            fn = getattr(kernels, f"prefill_attention_{p}")
            t = _median_us(lambda q=q, k=k, v=v, fn=fn: fn(q, k, v, scale), calls)
            cells += [f"{t:.0f} µs ({flops / t / 1e3:.0f} GFLOP/s)", f"{sdpa / t:.2f}×"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def linear_table(rows_list: list[int], calls: int, hidden: int = 576, intermediate: int = 1536,
                 qkv_out: int = 960) -> str:
    import torch

    from kestrel.model.quantization import linear_int8, linear_int8_reference, select_int8_matmul, symmetric_int8
    from kestrel.ops.dispatch import select_linear

    shapes = [(qkv_out, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    weights = [torch.randn(n, k).mul_(0.05).bfloat16() for n, k in shapes]
    quantized = [symmetric_int8(w) for w in weights]
    linear = select_linear(torch.device("cpu"), torch.bfloat16).linear
    int8_matmul = select_int8_matmul(torch.device("cpu"), torch.bfloat16)
    if int8_matmul is linear_int8_reference:
        raise SystemExit("no int8 kernel (AMX-INT8, AVX512-VNNI or AVX2) is available on this machine")
    table = ["| rows | bf16 | int8 (W8A8) | speed-up |", "|---|---|---|---|"]
    for rows in rows_list:
        xs = [torch.randn(rows, k).bfloat16() for _, k in shapes]
        bf16 = lambda xs=xs: [linear(x, w) for x, w in zip(xs, weights)]  # noqa: E731
        int8 = lambda xs=xs: [linear_int8(x, q, s, matmul=int8_matmul)  # noqa: E731
                              for x, (q, s) in zip(xs, quantized)]
        t_bf16, t_int8 = _interleaved_median_us(bf16, int8, calls)
        table.append(f"| {rows} | {t_bf16:.0f} µs | {t_int8:.0f} µs | {t_bf16 / t_int8:.2f}× |")
    return "\n".join(table)


def _interleaved_median_us(a: Callable[[], object], b: Callable[[], object], calls: int) -> tuple[float, float]:
    """Medians of a and b timed call by call in turn, so that a change in the machine's speed hits both."""
    for _ in range(3):
        a(), b()
    ta, tb = [], []
    for _ in range(calls):
        for fn, times in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(ta) * 1e6, statistics.median(tb) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 288, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--linear", action="store_true", help="the decoder projections, bf16 against int8")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    args = parser.parse_args()
    if args.linear:
        print(linear_table(args.rows, args.calls))
    else:
        print(prefill_attention_table(args.lengths, args.heads, args.kv_heads, args.head_dim, args.calls))


if __name__ == "__main__":
    main()
