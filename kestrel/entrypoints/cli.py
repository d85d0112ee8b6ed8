"""The `kestrel` command line.

    kestrel generate "PROMPT" [--chat] [--max-tokens N] [--temperature T] [engine flags]
    kestrel chat [engine flags]
    kestrel serve [MODEL] [--host H] [--port P] [--api-key K] [--served-model-name N] [engine flags]
    kestrel bench throughput [options] [engine flags]

Engine flags are named as vLLM names them and map one-to-one onto `EngineArgs` fields; they are
listed once, in ENGINE_FLAGS. A ValueError (bad model path, bad value) prints `error: <message>` and
exits 1, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kestrel.bench import throughput
from kestrel import config
from kestrel.config import EngineArgs
from kestrel.entrypoints.llm import LLM
from kestrel.sampling_params import SamplingParams

def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5GB' (decimal), '4096' (bytes)."""
    try:
        return config.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class EngineFlag:
    flag: str
    field: str                      # the EngineArgs field it sets
    type: Callable[[str], Any] | None = None
    help: str = ""
    action: Any = None              # argparse action for switches; None: takes a value of `type`


# One line per engine flag. Flags not given on the command line leave EngineArgs' default.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("--model", "model", str, "a .gguf file or a model folder (default: the embedded SmolLM2-135M-Instruct)"),
    EngineFlag("--dtype", "dtype", str, "auto, bfloat16, float16 or float32"),
    EngineFlag("--quantization", "quantization", str,
               "int8: the decoder layers' matrices in int8, activations quantized per token (W8A8)"),
    EngineFlag("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    EngineFlag("--max-model-len", "max_model_len", int, "context length (default: the model's)"),
    EngineFlag("--max-num-seqs", "max_num_seqs", int, "most sequences in one step"),
    EngineFlag("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    EngineFlag("--block-size", "block_size", int, "tokens per KV-cache block"),
    EngineFlag("--enable-prefix-caching", "enable_prefix_caching", help="reuse KV blocks of shared prefixes",
               action=argparse.BooleanOptionalAction),
    EngineFlag("--enable-chunked-prefill", "enable_chunked_prefill", help="split long prompts across steps",
               action=argparse.BooleanOptionalAction),
    EngineFlag("--gpu-memory-utilization", "gpu_memory_utilization", float, "fraction of GPU memory to use"),
    EngineFlag("--kv-cache-memory", "kv_cache_memory", parse_bytes, "KV-cache size in bytes, e.g. 2GiB, 512MiB"),
    EngineFlag("--num-kv-blocks", "num_kv_blocks", int, "exact number of KV-cache blocks"),
    EngineFlag("--kv-cache-dtype", "kv_cache_dtype", str,
               "auto (the model's dtype) or int8: K and V rows in int8 with a scale each, ~1.9x the tokens"),
    EngineFlag("--seed", "seed", int, "random seed (engine, and the sampling seed of generate/chat)"),
    EngineFlag("--enforce-eager", "enforce_eager", help="never capture graphs", action="store_true"),
)


def _engine_default(field: str) -> Any:
    f = EngineArgs.__dataclass_fields__[field]
    return f.default if f.default is not dataclasses.MISSING else None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine flags")
    for f in ENGINE_FLAGS:
        default = _engine_default(f.field)
        help_text = f"{f.help} (default: {default})" if default is not None else f.help
        kwargs: dict[str, Any] = dict(dest=f.field, default=argparse.SUPPRESS, help=help_text)
        if f.action is not None:
            kwargs["action"] = f.action
        else:
            kwargs["type"] = f.type
            kwargs["metavar"] = f.field.upper()
        group.add_argument(f.flag, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs keyword arguments for the engine flags given on the command line."""
    return {f.field: getattr(args, f.field) for f in ENGINE_FLAGS if hasattr(args, f.field)}


def add_sampling_flags(parser: argparse.ArgumentParser, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens,
                       help=f"most tokens to generate (default: {default_max_tokens})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1.0, off)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (default: 0, off)")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=getattr(args, "seed", None))


def run_generate(args: argparse.Namespace) -> int:
    llm = LLM(**engine_kwargs(args))
    params = sampling_params_from(args)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def read_user_line() -> str | None:
    """The next user line, or None at end of input or on /exit."""
    try:
        line = input("> ")
    except EOFError:
        print()
        return None
    return None if line.strip() == "/exit" else line


def run_chat(args: argparse.Namespace) -> int:
    llm = LLM(**engine_kwargs(args))
    params = sampling_params_from(args)
    if sys.stdin.isatty():
        print("Type a message; /exit or Ctrl-D to quit.", file=sys.stderr)
    history: list[dict[str, str]] = []
    while (line := read_user_line()) is not None:
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: drop the turn, go on
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from kestrel.entrypoints.openai.api_server import run_server
    return run_server(args)


def run_bench_throughput(args: argparse.Namespace) -> int:
    return throughput.main(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description="Kestrel: an LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="complete one prompt and print the text")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user message through the "
                                                              "model's chat template")
    add_sampling_flags(generate, default_max_tokens=64)
    add_engine_flags(generate)
    generate.set_defaults(handler=run_generate)

    chat = commands.add_parser("chat", help="chat interactively (reads lines from stdin)")
    add_sampling_flags(chat, default_max_tokens=256)
    add_engine_flags(chat)
    chat.set_defaults(handler=run_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="a .gguf file or a model folder (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $KESTREL_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model's own name)")
    serve.add_argument("--max-body-bytes", type=parse_bytes, default=8 << 20,
                       help="largest request body accepted, e.g. 8MiB (default: 8MiB)")
    serve.add_argument("--max-queued-requests", type=int, default=None,
                       help="answer 429 while this many accepted requests have no output yet (default: no limit)")
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: warning)")
    add_engine_flags(serve)
    serve.set_defaults(handler=run_serve)

    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    bench_throughput = benches.add_parser("throughput", help="offline throughput (workload W1)")
    throughput.add_cli_args(bench_throughput)
    add_engine_flags(bench_throughput)
    bench_throughput.set_defaults(handler=run_bench_throughput)
    from kestrel.bench import parity as bench_parity
    bench_parity_parser = benches.add_parser("parity", help="greedy agreement of a lossy mode (--quantization int8, "
                                                            "--kv-cache-dtype int8) with the default engine")
    bench_parity.add_cli_args(bench_parity_parser)
    add_engine_flags(bench_parity_parser)
    bench_parity_parser.set_defaults(handler=lambda args: bench_parity.main(args, engine_kwargs(args)))
    from kestrel.bench import serve as bench_serve
    bench_serve_parser = benches.add_parser("serve", help="online serving against an OpenAI-compatible URL "
                                                          "(workload W2)")
    bench_serve.add_cli_args(bench_serve_parser)
    bench_serve_parser.set_defaults(handler=bench_serve.main)
    from kestrel.bench import latency as bench_latency
    bench_latency_parser = benches.add_parser("latency", help="single-stream and 8-stream latency through the "
                                                              "server, with peers (workload W3)")
    bench_latency.add_cli_args(bench_latency_parser)
    bench_latency_parser.set_defaults(handler=bench_latency.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = shlex.join(["kestrel", *argv])
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
