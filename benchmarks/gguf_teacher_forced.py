"""How far a GGUF file's kept blocks (linear_gguf) move the model from its float32 run, against the
same weights dequantized in bf16: teacher-forced over plain text (the first 6,000 characters of a
file, in 4 prompts), each token's logprob (prompt_logprobs) and whether it is the top token, for
three runs of the same model: float32 (the weights dequantized; the reference), bf16 with the
weights dequantized, and bf16 with the blocks kept. Reported against the float32 run: the median
and 99th percentile of |logprob difference|, how often the top token differs, and the mean logprob.

    python benchmarks/gguf_teacher_forced.py [--model default|q8_0|PATH.gguf] [--text FILE]

`q8_0` is the default model requantized to Q8_0 (kestrel.bench.peers.gguf_in_precision); the default
model as shipped keeps its Q4_1 layers and its Q8_0 embedding and tied head. Each run is a process of its own, one
after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = {"float32": ("float32", False), "bf16 dequantized": ("bfloat16", False), "bf16 blocks kept": ("bfloat16", True)}
CHUNK_CHARS, CHUNKS = 1500, 4


def model_path(name: str) -> str:
    from kestrel.bench.peers import gguf_in_precision
    from kestrel.model.loader import default_model_path

    if name == "default":
        return str(default_model_path())
    if name == "q8_0":
        return str(gguf_in_precision(default_model_path(), "q8_0"))
    return name


def scored_tokens(model: str, text: str, dtype: str, keep_blocks: bool) -> list[tuple[float, int]]:
    """(logprob of each text token, the top token there), teacher-forced."""
    from kestrel import LLM, SamplingParams
    from kestrel.model import quantization as Q

    if not keep_blocks:
        Q.gguf_plan_matmul = lambda: None   # as the tests do: every weight dequantized at load
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, kv_cache_memory=160 << 20)
    chunks = [text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS] for i in range(CHUNKS)]
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
    scored = []
    for out in outs:
        for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
            top = max(entry.items(), key=lambda item: item[1].logprob)[0]
            scored.append((entry[token].logprob, top))
    return scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="q8_0")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--one-run", nargs=2, metavar=("DTYPE", "KEEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    text = args.text.read_text()[:CHUNK_CHARS * CHUNKS]
    if args.one_run:
        print(json.dumps(scored_tokens(model_path(args.model), text, args.one_run[0], args.one_run[1] == "1")))
        return
    runs = {}
    for label, (dtype, keep) in RUNS.items():
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--text", str(args.text),
                              "--one-run", dtype, str(int(keep))], check=True, capture_output=True, text=True)
        runs[label] = json.loads(out.stdout.strip().splitlines()[-1])
    reference = runs["float32"]
    print(f"{args.model}: {len(reference)} tokens of {args.text.name}, against the float32 run "
          f"(mean logprob {statistics.mean(lp for lp, _ in reference):.4f})")
    print("| run | median abs logprob diff | p99 | top token differs | mean logprob |")
    print("|---|---|---|---|---|")
    for label in ("bf16 dequantized", "bf16 blocks kept"):
        ours = runs[label]
        diffs = sorted(abs(a - b) for (a, _), (b, _) in zip(ours, reference))
        differ = sum(a != b for (_, a), (_, b) in zip(ours, reference)) / len(ours)
        print(f"| {label} | {statistics.median(diffs):.4f} | {diffs[int(0.99 * len(diffs))]:.3f} | "
              f"{differ:.1%} | {statistics.mean(lp for lp, _ in ours):.4f} |")


if __name__ == "__main__":
    main()
