"""Sweep llama-server's slot count (-np) on a workload, flash attention on, and print the median wall
time of each: how BENCHMARKS.md picks the peer's configuration (launch.LLAMA_BEST_NP).

    python benchmarks/llama_np_sweep.py [--workload W1|W4] [--np 8 16 32 64] [--runs 2] [--peer llama-server]
"""

from __future__ import annotations

import argparse
import os
import statistics

from kestrel.bench.launch import LLAMA_NP_ENV
from kestrel.bench.throughput import run_server_peer
from kestrel.bench.workloads import w1_offline_throughput, w4_shared_prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("W1", "W4"), default="W1")
    parser.add_argument("--np", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--peer", default="llama-server")
    args = parser.parse_args()
    requests = w4_shared_prefix() if args.workload == "W4" else w1_offline_throughput()
    rows = []
    for slots in args.np:
        os.environ[LLAMA_NP_ENV] = str(slots)
        result = run_server_peer(args.peer, requests, args.runs, args.workload, None)
        wall = statistics.median(result.run_wall_s)
        rows.append((slots, wall, result.output_tokens / wall, result.notes[0]))
        print(f"-np {slots}: runs {', '.join(f'{w:.2f}' for w in result.run_wall_s)} s", flush=True)
    print(f"\n| -np | {args.workload} wall (median of {args.runs}) | output tok/s | server |\n|---|---|---|---|")
    for slots, wall, rate, label in rows:
        print(f"| {slots} | {wall:.2f} s | {rate:.1f} | {label} |")


if __name__ == "__main__":
    main()
