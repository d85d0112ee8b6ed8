"""The `kestrel` command line.

    kestrel generate "PROMPT" [--chat] [--max-tokens N] [--temperature T] [engine flags]
    kestrel chat [engine flags]
    kestrel serve [MODEL] [--host H] [--port P] [--api-key K] [--served-model-name N]
                  [--enable-auto-tool-choice --tool-call-parser NAME] [engine flags]
    kestrel doctor [URL] [--window S] [--json]
    kestrel bench {throughput,latency,serve,parity,speculative} [options] [engine flags]

Engine flags are named as vLLM names them and map one-to-one onto `EngineArgs` fields; they are
listed once, in kestrel/engine/arg_utils.py (ENGINE_FLAGS). The benchmark commands are imported only
when `kestrel bench ...` runs, so the product commands do not load them. A ValueError (bad model path,
bad value) prints `error: <message>` and exits 1, without a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from kestrel.distributed.lifecycle import configure_program_logging
from kestrel.engine.arg_utils import ENGINE_FLAGS, add_engine_flags, engine_kwargs, parse_bytes
from kestrel.entrypoints import doctor as doctor_cli
from kestrel.entrypoints.llm import LLM
from kestrel.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kestrel.sampling_params import SamplingParams

__all__ = ["ENGINE_FLAGS", "build_parser", "engine_kwargs", "main", "parse_args", "parse_bytes"]


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


def build_parser(include_bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line; without `include_bench`, `bench` is listed but its sub-commands (and
    the benchmark modules they import) are left out."""
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
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format of the model's tool calls: hermes (Qwen, Hermes, SmolLM2), llama3_json "
                            "(Llama 3.1/3.2) (default: none)")
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="most top logprobs a request may ask for, per token (-1: the whole vocabulary; "
                            "default: 20, as vLLM's)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="write tokens in logprobs as 'token_id:N' (as vLLM's; a request can ask with "
                            "return_tokens_as_token_ids)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens in responses (as vLLM's)")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="accepted for vLLM compatibility: /load always reports the requests being served")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info (the tokenizer's configuration and chat template)")
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: warning)")
    add_engine_flags(serve)
    serve.set_defaults(handler=run_serve)

    doctor = commands.add_parser("doctor", help="which box limits a running server, with the evidence and the "
                                                "flag to change")
    doctor_cli.add_cli_args(doctor)
    doctor.set_defaults(handler=doctor_cli.main)

    bench = commands.add_parser("bench", help="benchmarks: throughput, latency, serve, parity, speculative, "
                                                  "structured")
    if include_bench:
        add_bench_commands(bench)
    return parser


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    from kestrel.bench import latency as bench_latency
    from kestrel.bench import parity as bench_parity
    from kestrel.bench import serve as bench_serve
    from kestrel.bench import speculative as bench_speculative
    from kestrel.bench import structured as bench_structured
    from kestrel.bench import throughput as bench_throughput

    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    throughput_parser = benches.add_parser("throughput", help="offline throughput (workloads W1, W4)")
    bench_throughput.add_cli_args(throughput_parser)
    add_engine_flags(throughput_parser)
    throughput_parser.set_defaults(handler=lambda args: bench_throughput.main(args, engine_kwargs(args)))
    parity_parser = benches.add_parser("parity", help="greedy agreement of a lossy mode (--quantization int8, "
                                                      "--kv-cache-dtype int8) with the default engine")
    bench_parity.add_cli_args(parity_parser)
    add_engine_flags(parity_parser)
    parity_parser.set_defaults(handler=lambda args: bench_parity.main(args, engine_kwargs(args)))
    serve_parser = benches.add_parser("serve", help="online serving against an OpenAI-compatible URL "
                                                    "(workload W2)")
    bench_serve.add_cli_args(serve_parser)
    serve_parser.set_defaults(handler=bench_serve.main)
    latency_parser = benches.add_parser("latency", help="single-stream and 8-stream latency through the "
                                                        "server, with peers (workload W3)")
    bench_latency.add_cli_args(latency_parser)
    latency_parser.set_defaults(handler=bench_latency.main)
    speculative_parser = benches.add_parser("speculative", help="n-gram speculative decoding against none "
                                                                "(workload W5)")
    bench_speculative.add_cli_args(speculative_parser)
    add_engine_flags(speculative_parser)
    speculative_parser.set_defaults(handler=lambda args: bench_speculative.main(args, engine_kwargs(args)))
    structured_parser = benches.add_parser("structured", help="a JSON schema's cost per decode step against none, "
                                                              "and its compile time")
    bench_structured.add_cli_args(structured_parser)
    add_engine_flags(structured_parser)
    structured_parser.set_defaults(handler=lambda args: bench_structured.main(args, engine_kwargs(args)))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line, loading the benchmark commands only for `kestrel bench ...`."""
    return build_parser(include_bench=list(argv[:1]) == ["bench"]).parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.command_line = shlex.join(["kestrel", *argv])
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def configure_logging() -> None:
    """Kestrel's log lines (the engine's periodic stats among them) on stderr, at
    $KESTREL_LOGGING_LEVEL (default INFO). Only the program does this, never the library."""
    configure_program_logging()  # the engine core and workers it spawns log the same way


def run() -> None:
    """The `kestrel` program: logging set up, then the command; exits with its status."""
    configure_logging()
    sys.exit(main())


if __name__ == "__main__":
    run()
