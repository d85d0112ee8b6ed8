"""`kestrel bench parity --quantization int8` (and/or `--kv-cache-dtype int8`): what a lossy mode costs
in agreement with the default engine (which the parity tests hold to transformers' tokens), on greedy
decoding.

For each prompt the default engine writes --max-tokens greedy tokens. Then:
- free-running: the lossy engine decodes greedily from the same prompt; reported: how many
  continuations are identical, and where the first differing token falls (median, as a fraction).
- teacher-forced: the lossy engine reads prompt + the reference continuation once
  (prompt_logprobs) and its top-1 token is compared at every continuation position, so one early
  difference does not hide the agreement after it.
With --kv-cache-dtype int8 the lossy engine prefills in chunks of 16 tokens, so that every chunk's
attention reads all its keys back from the int8 cache, as decoding does (a prompt prefilled in one
piece attends to its own keys unquantized).

The prompts are plain English requests sent through the model's chat template, so that the model's
predictions are confident where it is confident (random token ids, W1's prompts, make most
next-token choices near ties).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kestrel.bench.report import write_report

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "Give three tips for learning a new language.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "Write a haiku about autumn leaves.",
    "List the planets of the solar system in order.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "How does a refrigerator keep food cold?",
    "Translate 'good morning' into Spanish and French.",
    "Why do we have seasons on Earth?",
    "Write a function that checks whether a number is prime.",
    "What should I pack for a weekend camping trip?",
)


@dataclass(frozen=True)
class ParityResult:
    sequences: int
    identical: int
    first_difference: list[float]     # per differing sequence: position / length
    forced_positions: int
    forced_agree: int

    @property
    def forced_agreement(self) -> float:
        return self.forced_agree / self.forced_positions


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per continuation (default: 64)")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS),
                        help=f"how many of the built-in prompts (default: {len(PROMPTS)})")
    parser.add_argument("--append-md", type=Path, default=None, help="append the report to this Markdown file")


# The lossy settings and their defaults: the reference engine runs with these.
LOSSY_DEFAULTS = {"quantization": None, "kv_cache_dtype": "auto"}
KV_READ_CHUNK = 16


def lossy_flags(engine_kwargs: dict[str, Any]) -> str:
    """The lossy settings of `engine_kwargs` as command-line flags ("" if none)."""
    return " ".join(f"--{k.replace('_', '-')} {engine_kwargs[k]}" for k, default in LOSSY_DEFAULTS.items()
                    if engine_kwargs.get(k, default) != default)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS[:n]]


def measure(engine_kwargs: dict[str, Any], num_prompts: int, max_tokens: int) -> ParityResult:
    from kestrel import LLM, SamplingParams

    if not lossy_flags(engine_kwargs):
        raise ValueError("bench parity compares a lossy mode with the default one: pass --quantization or "
                         "--kv-cache-dtype")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reference_llm = LLM(**{**engine_kwargs, **LOSSY_DEFAULTS})
    prompts = chat_prompts(reference_llm.get_tokenizer(), num_prompts)
    references = [o.outputs[0].token_ids for o in reference_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    del reference_llm

    lossy = dict(engine_kwargs)
    if lossy.get("kv_cache_dtype", "auto") != "auto":
        lossy["max_num_batched_tokens"] = KV_READ_CHUNK
    llm = LLM(**lossy)
    free = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    forced = llm.generate([{"prompt_token_ids": p + list(r[:-1])} for p, r in zip(prompts, references)],
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    first_difference, agree, positions = [], 0, 0
    for prompt, ref, ours, out in zip(prompts, references, free, forced):
        if list(ours) != list(ref):
            n = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            first_difference.append(n / len(ref))
        # prompt_logprobs[p] scores token p given tokens < p; the continuation starts at len(prompt).
        for pos in range(len(prompt), len(prompt) + len(ref) - 1):
            entry = out.prompt_logprobs[pos]
            token = out.prompt_token_ids[pos]
            agree += entry[token].rank == 1
            positions += 1
        agree += out.outputs[0].token_ids[0] == ref[-1]  # the last reference token, as sampled
        positions += 1
    return ParityResult(len(prompts), len(prompts) - len(first_difference), first_difference, positions, agree)


def report(result: ParityResult, engine_kwargs: dict[str, Any], command: str, seconds: float) -> str:
    differing = result.sequences - result.identical
    median_first = f"{statistics.median(result.first_difference):.0%}" if result.first_difference else "n/a"
    return "\n".join([
        f"### Parity of {lossy_flags(engine_kwargs)} against the default engine "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Command: `{command}` ({seconds:.0f} s).",
        "",
        "| measure | value |",
        "|---|---|",
        f"| teacher-forced top-1 agreement | {result.forced_agreement:.1%} of {result.forced_positions} positions |",
        f"| identical greedy continuations | {result.identical} of {result.sequences} |",
        f"| first differing token, median over the {differing} that differ | {median_first} of the way in |",
        "",
    ])


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    start = time.perf_counter()
    result = measure(engine_kwargs, args.num_prompts, args.max_tokens)
    text = report(result, engine_kwargs, getattr(args, "command_line", "kestrel bench parity"),
                  time.perf_counter() - start)
    write_report(asdict(result), text, "\n" + text, None, args.append_md)
    return 0
