"""Input processing in the front end: validate, tokenize, fan `n` out into child requests.

Everything a user can get wrong is caught here with a ValueError naming the problem, before the
engine core sees the request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kestrel.config import ModelConfig
from kestrel.core.structured_output import check_structured_outputs
from kestrel.messages import EngineCoreRequest
from kestrel.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class Processor:
    def __init__(self, model_config: ModelConfig, tokenizer) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt:
            return self.tokenize_prompt(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def validate_prompt_ids(self, ids: list[int]) -> None:
        cfg = self.model_config
        if not ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                             f"max_model_len={cfg.max_model_len}; shorten the prompt or raise --max-model-len")
        bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {cfg.vocab_size}")

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word's token ids, as vLLM's `update_from_tokenizer`: the word as written (leading
        spaces stripped), and with one leading space when that tokenizes to as many tokens with a
        different first token (a word-start token, so that the word is banned mid-text too)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
            sequences.append(list(plain))
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(list(spaced))
        return sequences

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                arrival_time: float | None = None, priority: int = 0
                ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """(prompt text, prompt ids, one EngineCoreRequest per sample of `params.n`)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs)
        if params.bad_words:
            params = params.clone(bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        params.validate_vocab(self.model_config.vocab_size)
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt_ids(ids)
        arrival_time = arrival_time if arrival_time is not None else time.time()
        eos = self.model_config.eos_token_id
        num_samples = params.num_samples
        if num_samples == 1:
            if params.best_of is not None:
                params = params.clone(best_of=None)
            return text, ids, [EngineCoreRequest(request_id, ids, params, eos, arrival_time, priority)]
        # With best_of > n, the samples are ranked by cumulative logprob: each needs its sampled
        # token's logprob (logprobs=0), which the output processor drops if the user did not ask.
        logprobs = params.logprobs
        if num_samples > params.n and logprobs is None:
            logprobs = 0
        children = []
        for i in range(num_samples):
            # Each sample draws its own randomness; a seeded request stays reproducible. Prompt
            # logprobs are the same for every sample: only the first child computes them.
            child = params.clone(n=1, best_of=None, logprobs=logprobs,
                                 seed=None if params.seed is None else params.seed + i,
                                 prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            children.append(EngineCoreRequest(child_request_id(request_id, i), ids, child, eos,
                                              arrival_time, priority))
        return text, ids, children
