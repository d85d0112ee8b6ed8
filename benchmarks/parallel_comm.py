"""What tensor parallelism spends on communication, measured inside one W1 run (issue 18).

Runs W1 (64 requests, 64..512 prompt tokens, 32..256 output tokens, seed 0) at `--tp N` on the mp
executor and reports, per engine step:
- the time each rank spends inside the tensor-parallel all-reduce (two per layer, one for the
  embedding; waiting for the slower rank included, since that is what the step pays) and its share of
  the step's wall time;
- the `SchedulerOutput` broadcast: encoded bytes per step and the engine core's time to encode and
  publish it once for every worker;
- the all-reduce alone, in the same processes after the run: both ranks call it back to back on
  [rows, hidden] tensors of the model's dtype (decode-sized and prefill-sized), so that its transport
  cost is separated from waiting.

    python benchmarks/parallel_comm.py [--tp 2] [--dtype auto] [--output-json PATH]

Run it on an otherwise idle machine; it is one W1 run (about a minute at TP=2 on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kestrel import LLM, SamplingParams
from kestrel.bench.workloads import w1_offline_throughput
from kestrel.distributed import get_tp_group

ROWS = (1, 8, 64, 256, 512)
REPEATS = 200


def install_all_reduce_timer(worker) -> None:
    """Wrap this rank's tensor-parallel all-reduce with a clock (the model calls it through the group)."""
    group = get_tp_group()
    plain = group.all_reduce
    worker.all_reduce_clock = clock = [0, 0.0]

    def timed(t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = plain(t)
        clock[0] += 1
        clock[1] += time.perf_counter() - start
        return out

    group.all_reduce = timed


def read_all_reduce_timer(worker) -> tuple[int, float]:
    calls, seconds = worker.all_reduce_clock
    return calls, seconds


def all_reduce_alone(worker, hidden: int, dtype: torch.dtype, rows: tuple[int, ...], repeats: int
                     ) -> dict[int, float]:
    """Median seconds of one all-reduce of [r, hidden] per row count, every rank calling in step."""
    group = get_tp_group()
    result = {}
    for r in rows:
        t = torch.randn(r, hidden).to(dtype)
        for _ in range(10):
            group.all_reduce(t)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            group.all_reduce(t)
            times.append(time.perf_counter() - start)
        result[r] = statistics.median(times)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-json")
    args = parser.parse_args()

    requests = w1_offline_throughput()
    llm = LLM(tensor_parallel_size=args.tp, dtype=args.dtype, distributed_executor_backend="mp")
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    model = engine.config.model
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.output_len) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)   # warm up (prefix cache reset below)
    engine.engine_core.reset_prefix_cache()
    executor.collective_rpc(install_all_reduce_timer)
    steps0, bytes0, publish0 = executor.stats.steps, executor.stats.step_bytes, executor.stats.step_publish_s
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = executor.stats.steps - steps0
    clocks = executor.collective_rpc(read_all_reduce_timer)
    alone = executor.collective_rpc(all_reduce_alone, (model.hidden_size, model.dtype, ROWS, REPEATS))
    engine.shutdown()

    step_ms = wall / steps * 1e3
    report = {
        "tp": args.tp, "dtype": str(model.dtype).removeprefix("torch."), "wall_s": wall, "steps": steps,
        "step_ms": step_ms,
        "all_reduce_calls_per_step": [calls / steps for calls, _ in clocks],
        "all_reduce_ms_per_step": [seconds / steps * 1e3 for _, seconds in clocks],
        "all_reduce_share_of_step": [seconds / wall for _, seconds in clocks],
        "broadcast_bytes_per_step": (executor.stats.step_bytes - bytes0) / steps,
        "broadcast_us_per_step": (executor.stats.step_publish_s - publish0) / steps * 1e6,
        "all_reduce_alone_us": {str(r): alone[0][r] * 1e6 for r in ROWS},
        "hidden_size": model.hidden_size,
    }
    print(f"W1 at TP={args.tp} ({report['dtype']}): {wall:.1f} s, {steps} steps, {step_ms:.1f} ms per step")
    for rank, (ms, share, calls) in enumerate(zip(report["all_reduce_ms_per_step"], report["all_reduce_share_of_step"],
                                                  report["all_reduce_calls_per_step"])):
        print(f"  rank {rank}: all-reduce {ms:.2f} ms per step ({calls:.0f} calls), {share:.1%} of the step")
    print(f"  SchedulerOutput broadcast: {report['broadcast_bytes_per_step']:.0f} bytes per step, "
          f"{report['broadcast_us_per_step']:.0f} us to encode and publish")
    print("  all-reduce alone, [rows, %d] %s: %s" % (model.hidden_size, report["dtype"], ", ".join(
        f"{r} rows {alone[0][r] * 1e6:.0f} us" for r in ROWS)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
