"""`kestrel bench throughput`: workloads W1 (offline throughput) and W4 (shared prefix), against peers.

W4 (`--workload W4`): 64 requests sharing a 512-token prefix, each with 32 tokens of its own and 32
output tokens. Kestrel runs it twice, prefix caching on and off, and reports wall time and mean TTFT
(first token time minus arrival, from each request's metrics) for both.

Peers `llama-server[:bf16|:f32|:q4_1]` (kestrel/bench/launch.py): llama.cpp's server on the same
weights written in that precision (by default Kestrel's own dtype here: bf16, or f32 on a CPU
without bf16 instructions), or its native Q4_1 file. Every request is sent at once through the same
OpenAI-compatible client as `kestrel bench serve` (kestrel/bench/serve.py): W1 non-streaming with
`cache_prompt: false`; W4 streaming (for TTFT) with `cache_prompt: true`. Its peak memory is its
process's, sampled.

The machine's limits (kestrel/bench/roofline.py) are measured in the same run, before the engines:
bf16 and fp32 matmul GFLOP/s at the model's layer shapes and the copy rate; Kestrel's achieved
GFLOP/s on the workload (prompt tokens x 2 x non-embedding parameters + output tokens x 2 x all
parameters) is reported as a fraction of the rate in the model's dtype (bf16; float32 where the model
runs in float32, as on a CPU without bf16 instructions). That rate is measured again just before each
of Kestrel's timed runs, and each run's fraction of it is reported too, with their median: an AMX
machine's rate drifts between runs.

Kestrel: every request is submitted at once through `LLM.generate` (prompt token ids, greedy,
ignore_eos, max_tokens = the request's output length). Only `generate` is timed, after one short
warm-up; the prefix cache is emptied before each run so that a repeated run cannot hit the
previous run's blocks. The figure reported is the median of --runs runs.

Peer `transformers`: `model.generate` on the same weights in the same dtype, run in a child process
so that its memory is its own. Requests go in batches of --peer-batch-size, in request order,
left-padded; each batch generates up to its longest output (min_new_tokens = max_new_tokens), and
only each request's own output length counts as useful output.

Peak resident memory: the larger of the RSS sampled while the model loads and VmHWM at the end
(the engine resets VmHWM when it profiles memory, so VmHWM alone would miss the load peak).

This module holds the command line and the run's order; the engines' runs are in throughput_runs.py
(Kestrel, server peers) and transformers_peer.py, the report in throughput_report.py, and what every
benchmark shares in common.py and report.py.
"""

from __future__ import annotations

import argparse
import functools
import os
from datetime import UTC, datetime
from typing import Any

from kestrel.bench.common import log, set_torch_threads, warn_if_busy
from kestrel.bench.launch import PEER_SPECS
from kestrel.bench.report import write_report
from kestrel.bench.throughput_report import build_report, format_markdown, format_summary
from kestrel.bench.throughput_runs import run_kestrel, run_server_peer
from kestrel.bench.transformers_peer import PeerJob, run_transformers_peer_in_child
from kestrel.bench.workloads import (
    W1_INPUT_LEN_RANGE,
    W1_NUM_REQUESTS,
    W1_OUTPUT_LEN_RANGE,
    w1_offline_throughput,
    w4_shared_prefix,
)

PEERS = ("transformers", *PEER_SPECS)
WORKLOADS = ("W1", "W4")
DEFAULT_RUNS = 3
DEFAULT_PEER_BATCH_SIZE = 16


# ---- command line -------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=W1_NUM_REQUESTS,
                        help=f"number of requests (default: {W1_NUM_REQUESTS})")
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_INPUT_LEN_RANGE), help="prompt lengths, uniform, inclusive "
                        f"(default: {W1_INPUT_LEN_RANGE[0]} {W1_INPUT_LEN_RANGE[1]})")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_OUTPUT_LEN_RANGE), help="output lengths, uniform, inclusive "
                        f"(default: {W1_OUTPUT_LEN_RANGE[0]} {W1_OUTPUT_LEN_RANGE[1]})")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"timed runs per engine; the median is reported (default: {DEFAULT_RUNS})")
    parser.add_argument("--workload", choices=WORKLOADS, default="W1",
                        help="W1 (offline throughput) or W4 (shared prefix, caching on vs off) (default: W1)")
    parser.add_argument("--peer", action="append", choices=PEERS, default=[],
                        help="also run this peer (repeatable): transformers on the same weights and dtype; "
                             "llama-server on the weights written as bf16 or f32 (default: Kestrel's dtype here), "
                             "or its native q4_1 file")
    parser.add_argument("--no-roofline", dest="roofline", action="store_false",
                        help="skip measuring the machine's matmul and copy rates (W1 only: W4 never does)")
    parser.add_argument("--peer-batch-size", type=int, default=DEFAULT_PEER_BATCH_SIZE,
                        help=f"requests per transformers generate call (default: {DEFAULT_PEER_BATCH_SIZE})")
    parser.add_argument("--num-threads", type=int, help="torch threads for Kestrel and the peer alike "
                        "(default: torch's default, one per core)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file "
                                                            "(e.g. benchmarks/history/runs.md)")


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run the benchmark the parsed command line describes; print the report; 0 on success."""
    check_options(args)
    if args.workload == "W4":
        requests = w4_shared_prefix()
    else:
        requests = w1_offline_throughput(args.num_prompts, tuple(args.input_len_range),
                                         tuple(args.output_len_range))
    log(f"workload {args.workload}: {len(requests)} requests, {sum(r.input_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens")
    started = datetime.now(UTC)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    if args.num_threads:
        set_torch_threads(args.num_threads)
    limits = rate_before_run = None
    # W4's first engine skips the prefill its prefix cache holds: W1's FLOP count would not apply.
    if args.roofline and args.workload == "W1":
        limits = measure_machine_limits(engine_kwargs)
        from kestrel.bench.roofline import gflops_of
        rate_before_run = functools.partial(gflops_of, [tuple(x) for x in limits["shapes"]], limits["roofline_dtype"])
    results, engine_info = run_kestrel(requests, engine_kwargs, args.runs, args.workload, rate_before_run)
    for peer in args.peer:
        if peer == "transformers":
            results.append(run_transformers_peer_in_child(PeerJob(
                model_path=engine_info["model_path"], gguf_file=engine_info["gguf_file"],
                dtype=engine_info["dtype"], device=engine_info["device"], requests=requests,
                batch_size=args.peer_batch_size, runs=args.runs, num_threads=args.num_threads)))
        else:
            results.append(run_server_peer(peer, requests, args.runs, args.workload, engine_kwargs.get("model")))
    report = build_report(args, requests, results, engine_info, started, load_average, limits)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def measure_machine_limits(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from kestrel.bench.roofline import (
        kv_bytes_per_token,
        layer_shapes,
        measure_limits,
        model_param_counts,
        roofline_dtype,
    )
    from kestrel.config import resolve_device, resolve_dtype
    from kestrel.model.loader import load_config, resolve_model
    hf_config = load_config(resolve_model(engine_kwargs.get("model")))
    log("measuring the machine's matmul, copy and read rates")
    limits = measure_limits(layer_shapes(hf_config)).to_dict()
    params = model_param_counts(hf_config)
    dtype = resolve_dtype(engine_kwargs.get("dtype") or "auto", resolve_device(engine_kwargs.get("device") or "auto"))
    dtype_bytes = dtype.itemsize
    # --quantization int8 stores the decoder's projections in one byte (the output head stays).
    layer_bytes = 1 if engine_kwargs.get("quantization") == "int8" else dtype_bytes
    limits.update(non_embedding_params=params.non_embedding, output_head_params=params.output_head,
                  roofline_dtype=roofline_dtype(str(dtype).removeprefix("torch.")),
                  weight_bytes=params.non_embedding * layer_bytes + params.output_head * dtype_bytes,
                  kv_bytes_per_token=kv_bytes_per_token(hf_config, engine_kwargs.get("kv_cache_dtype") or "auto",
                                                        dtype_bytes))
    log(f"bf16 matmul {limits['bf16_gflops']:.0f} GFLOP/s, fp32 {limits['fp32_gflops']:.0f} GFLOP/s, "
        f"copy {limits['copy_gb_s']:.1f} GB/s, read {limits['read_gb_s']:.1f} GB/s")
    return limits


def check_options(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be at least 1, got {args.peer_batch_size}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
