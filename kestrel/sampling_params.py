"""Per-request sampling settings, shaped like vLLM's and OpenAI's.

`SamplingParams` crosses the API-server → engine-core boundary inside `EngineCoreRequest`, so it is a
msgspec struct. `validate()` raises `ValueError` naming the bad field; the front end calls it before a
request reaches the engine core, so the core never sees a bad request.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# Most top-N logprobs per prompt token (vLLM's default max_logprobs).
MAX_PROMPT_LOGPROBS = 20
# logit_bias values are clamped to this range, as OpenAI documents it and vLLM does.
MAX_LOGIT_BIAS = 100.0


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """What a request's output must match, as vLLM's `structured_outputs`: exactly one of a JSON
    schema (as JSON text), any JSON object, a regular expression, one of a list of strings, or an
    EBNF grammar (xgrammar's dialect, which reads GBNF). The engine core compiles it with xgrammar
    and masks the logits of each step to the tokens that keep the output inside it."""
    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kind_and_spec(self) -> tuple[str, str]:
        """(kind, text) of the one constraint set: the compiled-grammar cache's key. Raises ValueError
        when none or several are set."""
        given = [(kind, spec) for kind, spec in (
            ("json", self.json), ("json_object", "" if self.json_object else None), ("regex", self.regex),
            ("choice", None if self.choice is None else msgspec.json.encode(self.choice).decode()),
            ("grammar", self.grammar)) if spec is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, choice, "
                             f"grammar, got {[kind for kind, _ in given] or 'none'}")
        return given[0]


class SamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per generated token, plus the sampled one
    # Top-N logprobs per prompt token, plus the actual one (0: only the actual one). Its requests
    # skip prefix-cache hits so that every prompt position is computed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (JSON schema, regex, choice, grammar); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # Samples generated per prompt, of which the `n` with the highest cumulative logprob are returned
    # (OpenAI's completions `best_of`); None: n. Never streamed when larger than n.
    best_of: int | None = None
    # Added to the logits of these token ids before sampling (clamped to [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: the last token of a word's tokenization is banned whenever the output
    # ends with the tokens before it. The front end (processor.py) tokenizes each word, with and
    # without a leading space as vLLM does, into `bad_words_token_ids`, which the sampler uses.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            # OpenAI's keys are token ids as strings; values beyond ±100 are clamped, as vLLM does.
            bias = {}
            for token, value in self.logit_bias.items():
                try:
                    bias[int(token)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids and values numbers, got "
                                     f"{token!r}: {value!r}") from None
            self.logit_bias = bias

    @property
    def sampling_type(self) -> SamplingType:
        return SamplingType.GREEDY if self.temperature < GREEDY_TEMPERATURE else SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be positive")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            bad("prompt_logprobs", f"must be in [0, {MAX_PROMPT_LOGPROBS}]")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.structured_outputs is not None:
            self.structured_outputs.kind_and_spec()
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            bad("best_of", f"must be an integer >= n ({self.n})")
        if self.logit_bias is not None and any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
            bad("logit_bias", "keys must be non-negative token ids")
        if self.logit_bias is not None and any(v != v for v in self.logit_bias.values()):
            bad("logit_bias", "values must be numbers")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must not be empty")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids", "must be non-negative integers")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must be non-empty strings")

    def validate_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming the field whose token ids fall outside a vocabulary of `vocab_size`
        (the front end checks this, where the vocabulary is known)."""
        for field, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                           ("bad_words", [t for seq in self.bad_words_token_ids or () for t in seq])):
            out_of_range = sorted({t for t in ids if not 0 <= t < vocab_size})
            if out_of_range:
                raise ValueError(f"{field} has token ids out of range for a vocabulary of {vocab_size}: "
                                 f"{out_of_range[:10]}")

    @property
    def num_samples(self) -> int:
        """Samples generated: best_of when set, else n."""
        return self.n if self.best_of is None else self.best_of

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)
