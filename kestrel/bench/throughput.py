"""`kestrel bench throughput`: workloads W1 (offline throughput), W4 (shared prefix) and W6 (W1 on a
1B-class model), against peers.

W4 (`--workload W4`): 64 requests sharing a 512-token prefix, each with 32 tokens of its own and 32
output tokens. Kestrel runs it twice, prefix caching on and off, and reports wall time and mean TTFT
(first token time minus arrival, from each request's metrics) for both.

W6 (`--workload W6`): W1's requests (the same seed and lengths; prompt ids inside its 32000-token
vocabulary) on a Llama of TinyLlama-1.1B's shape with random weights (kestrel/bench/w6_model.py),
generated into Kestrel's cache folder on first use. Kestrel and `transformers` read its safetensors
folder (bf16); `llama-server:bf16` its bf16 GGUF file, `llama-server:q8_0`, `llama-server:q4_k` and
`llama-server:q5_k` llama-quantize's Q8_0, Q4_K_M and Q5_K_M files of it. `--kestrel-weights q8_0` (or
`q4_k_m`, `q5_k_m`) has Kestrel (and transformers) read that file instead, Kestrel keeping its weights
in the file's blocks.
The report names the file each engine read.

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

Peer `transformers`: `model.generate` on the same weights in the same dtype (`transformers:float32`
or `:bfloat16`: in that one, e.g. float32 where torch emulates bf16), run in a child process
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel.bench.common import log, set_torch_threads, warn_if_busy
from kestrel.bench.launch import KESTREL_WEIGHTS as SERVER_KESTREL_WEIGHTS
from kestrel.bench.launch import PEER_SPECS, bare_peer, peer_label
from kestrel.bench.report import write_report
from kestrel.bench.throughput_report import build_report, format_markdown, format_summary
from kestrel.bench.throughput_runs import run_kestrel, run_server_peer
from kestrel.bench.transformers_peer import PeerJob, run_transformers_peer_in_child
from kestrel.bench.workloads import (
    W1_INPUT_LEN_RANGE,
    W1_NUM_REQUESTS,
    W1_OUTPUT_LEN_RANGE,
    BenchRequest,
    w1_offline_throughput,
    w4_shared_prefix,
    w6_offline_throughput,
)

if TYPE_CHECKING:
    from kestrel.bench.w6_model import W6Model

TRANSFORMERS_PEERS = ("transformers", "transformers:float32", "transformers:bfloat16")
PEERS = (*TRANSFORMERS_PEERS, *PEER_SPECS)
WORKLOADS = ("W1", "W4", "W6")
W6_KESTREL_WEIGHTS = ("bf16", "q8_0", "q4_k_m", "q5_k_m")
KESTREL_WEIGHTS = (*W6_KESTREL_WEIGHTS, "native")   # W1 and W4: SERVER_KESTREL_WEIGHTS; W6: its files
# The llama-quantize file each of those reads (None: the safetensors folder).
W6_KESTREL_FILES: dict[str, str | None] = {"bf16": None, "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M"}
# W6's llama-server peers and the file each reads: its bf16 GGUF (None) or a llama-quantize type.
W6_PEER_FILES: dict[str, str | None] = {"llama-server:bf16": None, "llama-server:q8_0": "Q8_0",
                                        "llama-server:q4_k": "Q4_K_M", "llama-server:q5_k": "Q5_K_M"}
DEFAULT_RUNS = 3
DEFAULT_PEER_BATCH_SIZE = 16


# ---- command line -------------------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=W1_NUM_REQUESTS,
                        help=f"number of requests (default: {W1_NUM_REQUESTS}; W4's shared-prefix requests too)")
    parser.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_INPUT_LEN_RANGE), help="prompt lengths, uniform, inclusive "
                        f"(default: {W1_INPUT_LEN_RANGE[0]} {W1_INPUT_LEN_RANGE[1]})")
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                        default=list(W1_OUTPUT_LEN_RANGE), help="output lengths, uniform, inclusive "
                        f"(default: {W1_OUTPUT_LEN_RANGE[0]} {W1_OUTPUT_LEN_RANGE[1]})")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                        help=f"timed runs per engine; the median is reported (default: {DEFAULT_RUNS})")
    parser.add_argument("--workload", choices=WORKLOADS, default="W1",
                        help="W1 (offline throughput), W4 (shared prefix, caching on vs off) or W6 (W1's "
                             "requests on a random-weight Llama of TinyLlama-1.1B's shape, generated into "
                             "Kestrel's cache on first use) (default: W1)")
    parser.add_argument("--peer", action="append", choices=PEERS, default=[],
                        help="also run this peer (repeatable): transformers on the same weights and dtype "
                             "(transformers:float32 or :bfloat16 in that dtype instead); "
                             "llama-server on the weights written as bf16 or f32 (default: Kestrel's dtype here), "
                             "or its native q4_1 file; W6: llama-server:bf16 on its bf16 GGUF, :q8_0, :q4_k "
                             "and :q5_k on llama-quantize's Q8_0, Q4_K_M and Q5_K_M files")
    parser.add_argument("--kestrel-weights", choices=KESTREL_WEIGHTS, default="bf16",
                        help="the weights Kestrel runs. W1 and W4: bf16, a GGUF model's dequantized to bf16 at "
                             "load as the workloads are defined (--quantization none), or native, its file's "
                             "blocks as `kestrel serve` runs them (a bare llama-server peer then reads the same "
                             "file). W6: bf16, the safetensors folder; q8_0, q4_k_m or q5_k_m, llama-quantize's "
                             "Q8_0, Q4_K_M or Q5_K_M GGUF (the file llama-server:q8_0, :q4_k or :q5_k reads), its "
                             "weights kept in the file's blocks (default: bf16)")
    parser.add_argument("--no-roofline", dest="roofline", action="store_false",
                        help="skip measuring the machine's matmul and copy rates (W1 and W6 only: W4 never does)")
    parser.add_argument("--peer-batch-size", type=int, default=DEFAULT_PEER_BATCH_SIZE,
                        help=f"requests per transformers generate call (default: {DEFAULT_PEER_BATCH_SIZE})")
    parser.add_argument("--num-threads", type=int, help="torch threads for Kestrel and the peer alike "
                        "(default: torch's default, one per core)")
    parser.add_argument("--output-json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--append-md", metavar="PATH", help="append a section to this Markdown file "
                                                            "(e.g. benchmarks/history/runs.md)")


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run the benchmark the parsed command line describes; print the report; 0 on success."""
    check_options(args, engine_kwargs)
    requests = workload_requests(args)
    w6 = None
    if args.workload == "W6":
        from kestrel.bench.w6_model import w6_model
        w6 = w6_model()
        engine_kwargs = {**engine_kwargs, "model": str(w6_kestrel_model(args.kestrel_weights, w6))}
    if args.kestrel_weights == "bf16" and not engine_kwargs.get("quantization"):
        engine_kwargs = {**engine_kwargs, "quantization": "none"}   # the workload's bf16 weights
    log(f"workload {args.workload}: {len(requests)} requests, {sum(r.input_len for r in requests)} prompt tokens, "
        f"{sum(r.output_len for r in requests)} output tokens")
    started = datetime.now(UTC)
    load_average = os.getloadavg()
    warn_if_busy(load_average[0])
    if args.num_threads:
        set_torch_threads(args.num_threads)
    limits = rate_before_run = None
    # W4's first engine skips the prefill its prefix cache holds: W1's FLOP count would not apply.
    if args.roofline and args.workload in ("W1", "W6"):
        limits = measure_machine_limits(engine_kwargs, gguf_blocks=args.kestrel_weights != "bf16")
        from kestrel.bench.roofline import gflops_of
        rate_before_run = functools.partial(gflops_of, [tuple(x) for x in limits["shapes"]], limits["roofline_dtype"])
    results, engine_info = run_kestrel(requests, engine_kwargs, args.runs, args.workload, rate_before_run)
    for peer in args.peer:
        if peer in TRANSFORMERS_PEERS:
            results.append(run_transformers_peer_in_child(PeerJob(
                model_path=engine_info["model_path"], gguf_file=engine_info["gguf_file"],
                dtype=transformers_dtype(peer, engine_info["dtype"]), device=engine_info["device"], requests=requests,
                batch_size=args.peer_batch_size, runs=args.runs, num_threads=args.num_threads)))
        else:
            gguf = w6_peer_gguf(peer, w6) if w6 is not None else None
            # A bare llama-server runs Kestrel's weights: the precision of the dtype Kestrel ran in, or the file.
            results.append(run_server_peer(bare_peer(peer, engine_info["dtype"], args.kestrel_weights), requests,
                                           args.runs, args.workload, engine_kwargs.get("model"), gguf))
    report = build_report(args, requests, results, engine_info, started, load_average, limits)
    write_report(report, format_summary(report), format_markdown(report), args.output_json, args.append_md)
    return 0


def transformers_dtype(spec: str, kestrel_dtype: str) -> str:
    """The dtype the transformers peer runs in: Kestrel's ("transformers"), or the one the spec names.
    Where a CPU has no bf16 instructions torch emulates bf16 products at a fraction of float32's
    rate, so a transformers user there runs float32: `transformers:float32` is that peer."""
    return spec.partition(":")[2] or kestrel_dtype


def workload_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.workload == "W4":
        return w4_shared_prefix(num_requests=args.num_prompts)
    draw = w6_offline_throughput if args.workload == "W6" else w1_offline_throughput
    return draw(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range))


def w6_peer_gguf(peer: str, model: W6Model) -> Path:
    """The GGUF file a llama-server peer reads in W6 (llama-quantize runs the first time)."""
    from kestrel.bench.w6_model import quantized_gguf
    quant_type = W6_PEER_FILES[peer_label(peer)]
    return model.bf16_gguf if quant_type is None else quantized_gguf(model, quant_type)


def w6_kestrel_model(weights: str, model: W6Model) -> Path:
    """What Kestrel reads in W6: the safetensors folder (bf16), or llama-quantize's Q8_0, Q4_K_M or Q5_K_M file."""
    from kestrel.bench.w6_model import quantized_gguf
    quant_type = W6_KESTREL_FILES[weights]
    return model.hf_folder if quant_type is None else quantized_gguf(model, quant_type)


def gguf_read_bytes(path: str) -> int:
    """The bytes a decode step reads of a GGUF file's weights: every tensor as the file stores it, but
    the embedding (a few rows per step) unless it is also the output head."""
    from kestrel.model.gguf_loader import read_gguf_header
    tensors = read_gguf_header(path).tensors
    tied = "output.weight" not in tensors
    return sum(info.n_bytes for name, info in tensors.items() if tied or name != "token_embd.weight")


def measure_machine_limits(engine_kwargs: dict[str, Any], gguf_blocks: bool = False) -> dict[str, Any]:
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
    from kestrel.ops import cpu_prefers_bf16
    dtype = resolve_dtype(engine_kwargs.get("dtype") or "auto", resolve_device(engine_kwargs.get("device") or "auto"),
                          cpu_prefers_bf16)
    dtype_bytes = dtype.itemsize
    # --quantization int8 stores the decoder's projections in one byte (the output head stays); a GGUF
    # file's kept matrices, the output head too, are read as the file stores them.
    layer_bytes = 1 if engine_kwargs.get("quantization") == "int8" else dtype_bytes
    weight_bytes = params.non_embedding * layer_bytes + params.output_head * dtype_bytes
    if gguf_blocks:
        from kestrel.model.loader import default_model_path
        weight_bytes = gguf_read_bytes(engine_kwargs.get("model") or str(default_model_path()))
    limits.update(non_embedding_params=params.non_embedding, output_head_params=params.output_head,
                  roofline_dtype=roofline_dtype(str(dtype).removeprefix("torch.")),
                  weight_bytes=weight_bytes,
                  kv_bytes_per_token=kv_bytes_per_token(hf_config, engine_kwargs.get("kv_cache_dtype") or "auto",
                                                        dtype_bytes))
    log(f"bf16 matmul {limits['bf16_gflops']:.0f} GFLOP/s, fp32 {limits['fp32_gflops']:.0f} GFLOP/s, "
        f"copy {limits['copy_gb_s']:.1f} GB/s, read {limits['read_gb_s']:.1f} GB/s")
    return limits


def check_options(args: argparse.Namespace, engine_kwargs: dict[str, Any] | None = None) -> None:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    if args.peer_batch_size < 1:
        raise ValueError(f"--peer-batch-size must be at least 1, got {args.peer_batch_size}")
    if args.num_threads is not None and args.num_threads < 1:
        raise ValueError(f"--num-threads must be at least 1, got {args.num_threads}")
    servers = [p for p in args.peer if p not in TRANSFORMERS_PEERS]
    if args.workload == "W6":
        if (engine_kwargs or {}).get("model"):
            raise ValueError("--workload W6 runs its own generated model; drop --model")
        unknown = [p for p in servers if peer_label(p) not in W6_PEER_FILES]
        if unknown:
            raise ValueError(f"W6's llama-server peers are {', '.join(W6_PEER_FILES)}; got {', '.join(unknown)}")
    elif args.kestrel_weights not in SERVER_KESTREL_WEIGHTS:
        raise ValueError("--kestrel-weights q8_0, q4_k_m and q5_k_m pick a file of W6's model: use them with "
                         "--workload W6")
    if args.workload == "W6" and args.kestrel_weights == "native":
        raise ValueError("--kestrel-weights native runs a GGUF file's own blocks: W6's are q8_0, q4_k_m or q5_k_m")
    for given in [p for p in servers if peer_label(p) in ("llama-server:q4_k", "llama-server:q5_k")]:
        if args.workload != "W6":
            raise ValueError(f"{given} reads llama-quantize's file of W6's model: use it with --workload W6")
