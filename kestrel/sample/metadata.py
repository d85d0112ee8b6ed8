"""Per-step sampling settings of a batch, as tensors on the sampling device.

The model runner builds one `SamplingMetadata` per step with `SamplingMetadata.build`; row b belongs
to `params[b]`. A setting no row uses is `None`, so the sampler skips that work entirely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kestrel.sampling_params import SamplingParams, SamplingType

_SEED_MULTIPLIER = 1_000_003
_MASK_63_BITS = (1 << 63) - 1


def seed_for_position(seed: int, position: int) -> int:
    """Generator seed for output position `position` of a request seeded with `seed`.

    It depends on nothing else, so a seeded request draws the same token at a position whatever
    else is in the batch and whether or not it was preempted and resumed.
    """
    return (seed * _SEED_MULTIPLIER + position) & _MASK_63_BITS


@dataclass
class SamplingMetadata:
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] float32; 1.0 on greedy rows. None when every row is greedy.
    temperature: torch.Tensor | None
    # [B] bool, True on greedy rows. Only for batches mixing greedy and random rows.
    greedy_mask: torch.Tensor | None
    # Filters of random rows, [B] each; None when no random row uses the filter.
    top_k: torch.Tensor | None   # int64 in [1, V]; V on rows without top-k
    top_p: torch.Tensor | None   # float32; 1.0 on rows without top-p
    min_p: torch.Tensor | None   # float32; 0.0 on rows without min-p
    # Random rows with a seed: row -> seed of this step's generator (see `seed_for_position`).
    row_seeds: dict[int, int]
    # Penalties, [B] float32 each; None when no row uses that penalty.
    no_penalties: bool
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [B, L] int64 token ids padded with vocab_size. Output ids exist when any penalty is used,
    # prompt ids only when a repetition penalty is.
    output_token_ids: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    # (row, token) pairs whose logits are -inf this step (min_tokens not yet reached).
    min_tokens_rows: torch.Tensor | None
    min_tokens_token_ids: torch.Tensor | None
    # Largest top-N logprobs asked by any row; None when no row asks for logprobs.
    max_num_logprobs: int | None
    # allowed_token_ids: the rows that have them [R] int64, and [R, V] bool, True on the tokens those
    # rows may not sample.
    allowed_rows: torch.Tensor | None = None
    disallowed_mask: torch.Tensor | None = None
    # bad_words: (row, token) pairs whose logits are -inf this step (the output ends with all but the
    # last token of a bad word).
    bad_words_rows: torch.Tensor | None = None
    bad_words_token_ids: torch.Tensor | None = None
    # logit_bias: (row, token, bias) triples added to the logits.
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_token_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    # Structured outputs: [R, ceil(V / 32)] int32 bitmask (xgrammar's layout) of the allowed tokens of
    # logits rows `token_bitmask_rows` [R] int64; None when no row is constrained.
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        """Whether any step before sampling changes the logits (a greedy batch where none does takes
        the argmax of the caller's tensor as it is)."""
        return not (self.all_greedy and self.no_penalties and self.min_tokens_rows is None
                    and self.allowed_rows is None and self.bad_words_rows is None and self.logit_bias_rows is None
                    and self.token_bitmask is None)

    def constrain(self, bitmask: torch.Tensor, rows: list[int]) -> SamplingMetadata:
        """This metadata with logits rows `rows` limited to the tokens of `bitmask`'s rows."""
        self.token_bitmask = bitmask
        self.token_bitmask_rows = torch.tensor(rows, dtype=torch.int64, device=bitmask.device)
        return self

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], eos_token_ids: list[int | None],
              vocab_size: int, device: torch.device) -> SamplingMetadata:
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def random_row_setting(value: Callable[[SamplingParams], float], disabled: float,
                               dtype: torch.dtype) -> torch.Tensor | None:
            values = [disabled if g else value(p) for p, g in zip(params, greedy)]
            if all(v == disabled for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        def penalty(value: Callable[[SamplingParams], float], neutral: float) -> torch.Tensor | None:
            values = [value(p) for p in params]
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = None if all_greedy else torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy)],
            dtype=torch.float32, device=device)
        greedy_mask = (None if all_greedy or all_random
                       else torch.tensor(greedy, dtype=torch.bool, device=device))

        presence = penalty(lambda p: p.presence_penalty, 0.0)
        frequency = penalty(lambda p: p.frequency_penalty, 0.0)
        repetition = penalty(lambda p: p.repetition_penalty, 1.0)
        no_penalties = presence is None and frequency is None and repetition is None

        min_tokens_rows, min_tokens_token_ids = _min_tokens_mask(
            params, output_token_ids, eos_token_ids, vocab_size, device)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        allowed_rows, disallowed_mask = _allowed_token_ids_mask(params, vocab_size, device)
        bad_words_rows, bad_words_token_ids = _bad_words_mask(params, output_token_ids, device)
        bias_rows, bias_token_ids, bias_values = _logit_bias(params, device)

        return cls(
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            greedy_mask=greedy_mask,
            top_k=random_row_setting(lambda p: _effective_top_k(p.top_k, vocab_size),
                                     vocab_size, torch.int64),
            top_p=random_row_setting(lambda p: p.top_p, 1.0, torch.float32),
            min_p=random_row_setting(lambda p: p.min_p, 0.0, torch.float32),
            row_seeds={row: seed_for_position(p.seed, len(output_token_ids[row]))
                       for row, (p, g) in enumerate(zip(params, greedy))
                       if not g and p.seed is not None},
            no_penalties=no_penalties,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            output_token_ids=(None if no_penalties
                              else pad_token_ids(output_token_ids, vocab_size, device)),
            prompt_token_ids=(None if repetition is None
                              else pad_token_ids(prompt_token_ids, vocab_size, device)),
            min_tokens_rows=min_tokens_rows,
            min_tokens_token_ids=min_tokens_token_ids,
            max_num_logprobs=max(asked) if asked else None,
            allowed_rows=allowed_rows,
            disallowed_mask=disallowed_mask,
            bad_words_rows=bad_words_rows,
            bad_words_token_ids=bad_words_token_ids,
            logit_bias_rows=bias_rows,
            logit_bias_token_ids=bias_token_ids,
            logit_bias_values=bias_values,
        )


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def pad_token_ids(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, max len] int64, padded with `vocab_size` (a bin the penalty code counts, then drops)."""
    width = max((len(r) for r in rows), default=0)
    padded = [r + [vocab_size] * (width - len(r)) for r in rows]
    ids = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)
    # Ids past the vocabulary land in the pad bin instead of indexing out of range.
    return ids.clamp_(max=vocab_size)


def _min_tokens_mask(params: list[SamplingParams], output_token_ids: list[list[int]],
                     eos_token_ids: list[int | None], vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows, token ids) to mask: the stop ids and EOS of rows that have generated fewer than
    min_tokens. EOS is masked even with ignore_eos, as in vLLM."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (p, output, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
        if len(output) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if eos is not None:
            stops.add(eos)
        for token in sorted(t for t in stops if 0 <= t < vocab_size):
            rows.append(row)
            token_ids.append(token)
    if not rows:
        return None, None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device))


def _allowed_token_ids_mask(params: list[SamplingParams], vocab_size: int, device: torch.device
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows with allowed_token_ids, [rows, V] True on each such row's tokens outside its list)."""
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None, None
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        mask[i].index_fill_(0, _token_ids_tensor(tuple(params[row].allowed_token_ids)), False)
    return (torch.tensor(rows, dtype=torch.int64, device=device), mask.to(device))


@functools.lru_cache(maxsize=64)  # at most ~50 MB for 64 lists of a whole 49k vocabulary
def _token_ids_tensor(token_ids: tuple[int, ...]) -> torch.Tensor:
    """A request's list of token ids as a CPU tensor, made once and not every step (thousands of
    allowed ids, one list → tensor each step, would cost milliseconds per row)."""
    return torch.tensor(token_ids, dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def _bias_tensors(bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, biases) CPU tensors, made once."""
    return (torch.tensor([t for t, _ in bias], dtype=torch.int64),
            torch.tensor([v for _, v in bias], dtype=torch.float32))


def _bad_words_mask(params: list[SamplingParams], output_token_ids: list[list[int]], device: torch.device
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(rows, token ids) to mask, as vLLM V1: a bad word's last token, on rows whose output ends
    with the word's other tokens (a one-token word is always masked)."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, p in enumerate(params):
        if not p.bad_words_token_ids:
            continue
        output = output_token_ids[row]
        for word in p.bad_words_token_ids:
            prefix_len = len(word) - 1
            if prefix_len > len(output):
                continue
            if prefix_len == 0 or output[-prefix_len:] == word[:-1]:
                rows.append(row)
                token_ids.append(word[-1])
    if not rows:
        return None, None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(token_ids, dtype=torch.int64, device=device))


def _logit_bias(params: list[SamplingParams], device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(rows, token ids, biases) of every row's logit_bias."""
    rows = [row for row, p in enumerate(params) if p.logit_bias]
    if not rows:
        return None, None, None
    tensors = [_bias_tensors(tuple(params[row].logit_bias.items())) for row in rows]
    flat_rows = torch.tensor(rows, dtype=torch.int64).repeat_interleave(torch.tensor([len(t) for t, _ in tensors]))
    return (flat_rows.to(device), torch.cat([t for t, _ in tensors]).to(device),
            torch.cat([v for _, v in tensors]).to(device))
