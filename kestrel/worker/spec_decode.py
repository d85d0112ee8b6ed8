"""Proposers of draft tokens for speculative decoding, run by the model runner after each step for the
requests that sampled; the drafts go back to the scheduler, which schedules them for verification.

`NgramProposer` (prompt lookup): the context's last n tokens, for n from `prompt_lookup_max` down to
`prompt_lookup_min`, are looked for earlier in the context; the tokens that followed their latest
earlier occurrence are the drafts. It costs no forward pass, and pays off where outputs repeat their
inputs (editing, summarising with quotes, code).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kestrel.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k drafts to follow `token_ids`, or none when no n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # Windows that end before the last token, so that a token follows each of them.
            windows = sliding_window_view(tokens[:length - 1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = starts[-1] + n
                return tokens[follow:follow + self.k].tolist()
        return []
