"""Workload generators for the benchmarks (see bench/WORKLOADS.md in the shared folder).

Every workload is random token ids drawn from a fixed seed, so every engine and every peer gets the
same requests. The draw order is part of the definition, so that another tool can reproduce it:
one `numpy.random.default_rng(seed)`; first the input lengths, then the output lengths (both
uniform over inclusive ranges), then each prompt's token ids in request order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKEN_ID_RANGE = (100, 40000)   # inclusive; inside the default model's vocabulary (49152)


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """TOKEN_ID_RANGE cut to a vocabulary of `vocab_size` ids (Llama 2's and TinyLlama's hold 32000)."""
    return TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], vocab_size - 1)

# W1: offline throughput.
W1_NUM_REQUESTS = 64
W1_INPUT_LEN_RANGE = (64, 512)
W1_OUTPUT_LEN_RANGE = (32, 256)
W1_SEED = 0


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int   # tokens to generate (greedy, ignore_eos, max_tokens = output_len)

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


def uniform_lengths(rng: np.random.Generator, n: int, length_range: tuple[int, int]) -> list[int]:
    """n lengths drawn uniformly from the inclusive range."""
    low, high = length_range
    if not 1 <= low <= high:
        raise ValueError(f"a length range must satisfy 1 <= low <= high, got {low}..{high}")
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_token_ids(rng: np.random.Generator, length: int,
                     id_range: tuple[int, int] = TOKEN_ID_RANGE) -> list[int]:
    low, high = id_range
    return [int(x) for x in rng.integers(low, high + 1, size=length)]


def random_requests(num_requests: int, input_len_range: tuple[int, int],
                    output_len_range: tuple[int, int], seed: int,
                    id_range: tuple[int, int] = TOKEN_ID_RANGE) -> list[BenchRequest]:
    """Requests with random token-id prompts; lengths and ids all come from one seeded generator."""
    if num_requests < 1:
        raise ValueError(f"the number of requests must be at least 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    input_lens = uniform_lengths(rng, num_requests, input_len_range)
    output_lens = uniform_lengths(rng, num_requests, output_len_range)
    return [BenchRequest(random_token_ids(rng, n_in, id_range), n_out) for n_in, n_out in zip(input_lens, output_lens)]


def w1_offline_throughput(num_requests: int = W1_NUM_REQUESTS,
                          input_len_range: tuple[int, int] = W1_INPUT_LEN_RANGE,
                          output_len_range: tuple[int, int] = W1_OUTPUT_LEN_RANGE,
                          seed: int = W1_SEED) -> list[BenchRequest]:
    """W1: all requests submitted at once; the defaults are the workload as defined."""
    return random_requests(num_requests, input_len_range, output_len_range, seed)


def is_standard_w1(num_requests: int, input_len_range: tuple[int, int],
                   output_len_range: tuple[int, int]) -> bool:
    return (num_requests == W1_NUM_REQUESTS and tuple(input_len_range) == W1_INPUT_LEN_RANGE
            and tuple(output_len_range) == W1_OUTPUT_LEN_RANGE)


# W6: W1 on a 1B-class model (kestrel/bench/w6_model.py) whose vocabulary has 32000 tokens.
W6_TOKEN_ID_RANGE = (100, 31999)


def w6_offline_throughput(num_requests: int = W1_NUM_REQUESTS,
                          input_len_range: tuple[int, int] = W1_INPUT_LEN_RANGE,
                          output_len_range: tuple[int, int] = W1_OUTPUT_LEN_RANGE,
                          seed: int = W1_SEED) -> list[BenchRequest]:
    """W6: W1's requests (the same seed, so the same lengths: they are drawn before the ids) with
    prompt ids inside the smaller vocabulary."""
    return random_requests(num_requests, input_len_range, output_len_range, seed, W6_TOKEN_ID_RANGE)


def warm_up_requests() -> list[BenchRequest]:
    """Two short requests unrelated to every workload (another seed), to warm an engine's code paths;
    their ids fit every benchmarked vocabulary (W6's, the smallest)."""
    return random_requests(2, (16, 32), (4, 4), seed=W1_SEED + 1, id_range=W6_TOKEN_ID_RANGE)


# W4: shared prefix.
W4_NUM_REQUESTS = 64
W4_PREFIX_LEN = 512
W4_UNIQUE_LEN = 32
W4_OUTPUT_LEN = 32
W4_SEED = 0


def w4_shared_prefix(num_requests: int = W4_NUM_REQUESTS, prefix_len: int = W4_PREFIX_LEN,
                     unique_len: int = W4_UNIQUE_LEN, output_len: int = W4_OUTPUT_LEN,
                     seed: int = W4_SEED) -> list[BenchRequest]:
    """W4: one random prefix shared by every request, then each request's own random tokens."""
    rng = np.random.default_rng(seed)
    prefix = random_token_ids(rng, prefix_len)
    return [BenchRequest(prefix + random_token_ids(rng, unique_len), output_len) for _ in range(num_requests)]


# W5: copy-heavy (speculative decoding).
W5_NUM_REQUESTS = 32
W5_LIST_LINES = 13        # about 300 prompt tokens with the default model's tokenizer and chat template
W5_OUTPUT_LEN = 200
W5_SEED = 0
_W5_ITEMS = ("blue widget", "steel bolt", "oak plank", "copper wire", "glass jar", "paper roll", "wool scarf",
             "clay pot", "brass hinge", "linen towel", "cedar box", "rubber seal", "cotton rope", "tin can")
_W5_CITIES = ("Lyon", "Porto", "Graz", "Turku", "Ghent", "Split", "Bergen", "Brno", "Cork", "Pisa", "Malmo", "Bonn")


def w5_copy_messages(num_requests: int = W5_NUM_REQUESTS, seed: int = W5_SEED) -> list[list[dict[str, str]]]:
    """W5: per request a chat asking to repeat an order list of W5_LIST_LINES lines with one line
    changed; the lists and the line to change are drawn from one seeded generator, in request order."""
    rng = np.random.default_rng(seed)
    chats = []
    for _ in range(num_requests):
        lines = [f"{i + 1}. Order #{int(rng.integers(10000, 99999))}: {int(rng.integers(1, 9))} x "
                 f"{_pick(rng, _W5_ITEMS)}, shipped to {_pick(rng, _W5_CITIES)}" for i in range(W5_LIST_LINES)]
        changed = int(rng.integers(1, W5_LIST_LINES + 1))
        city = _pick(rng, _W5_CITIES)
        ask = f"Repeat the list exactly, line by line, but in line {changed} change the city to {city}."
        chats.append([{"role": "user", "content": "Here is a list of orders:\n" + "\n".join(lines) + "\n\n" + ask}])
    return chats


def _pick(rng: np.random.Generator, choices: tuple[str, ...]) -> str:
    return choices[int(rng.integers(len(choices)))]
