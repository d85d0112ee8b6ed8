"""Proposers of draft tokens for speculative decoding, run by the model runner after each step for the
requests that sampled; the drafts go back to the scheduler, which schedules them for verification.

`NgramProposer` (prompt lookup): the context's last n tokens, for n from `prompt_lookup_max` down to
`prompt_lookup_min`, are looked for earlier in the context; the tokens that followed their latest
earlier occurrence are the drafts. It costs no forward pass, and pays off where outputs repeat their
inputs (editing, summarising with quotes, code).

`DraftModelProposer`: a smaller model with the target's vocabulary guesses k tokens, one forward each
(see its docstring for how its KV cache follows the target's).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import nn

from kestrel.attention import AttentionBackend, CommonAttentionMetadata, KVCache, new_kv_caches
from kestrel.config import EngineConfig, SpeculativeConfig
from kestrel.model.decode_plan import DecodePlan
from kestrel.sample.metadata import seed_for_position
from kestrel.sample.sampler import sample_by_exponential_race
from kestrel.sampling_params import SamplingParams, SamplingType
from kestrel.worker.batch import describe_batch, slots_of

# A seeded request's draft draws use generators seeded apart from those of its sampled tokens.
_DRAFT_SEED_SALT = 0xD4AF7


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


class DraftModelProposer:
    """The draft_model method: a smaller model, in the target's worker, with its own KV cache laid out
    in the same blocks as the target's (same block ids, same slots), so the scheduler's blocks serve
    both and a prefix-cache hit is a hit for both.

    Invariant: wherever the target's cache holds a token's K and V, the draft's holds its own for the
    same token. Every forward of the target is mirrored by one of the draft over the same tokens and
    slots (`mirror`), prefill chunks and verified drafts included. After a step, `propose` runs k
    one-token steps of the draft from each sampling request's newest token; they write K and V at
    positions not known yet, into the lookahead slots the scheduler held for them, and are overwritten
    when those positions are computed for real.

    Drafts of a greedy request are the draft's argmax; those of a random one are drawn from the draft's
    softmax at the request's temperature, q, which is returned with them: the rejection sampler needs
    q to keep the output distributed as the target's.
    """

    def __init__(self, config: EngineConfig, model: nn.Module, attn: AttentionBackend) -> None:
        assert config.draft_model is not None and config.speculative is not None
        self.config = config
        self.model_config = config.draft_model
        self.model = model
        self.attn = attn
        self.k = config.speculative.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.device = config.device.device
        self.max_model_len = config.scheduler.max_model_len
        self.plan = None if config.enforce_eager else DecodePlan.build(model, attn)
        self.kv_caches: list[KVCache] = []

    def kv_bytes_per_token(self) -> int:
        return self.model.shard.kv_bytes_per_token(self.model_config, self.config.cache.kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m, shard = self.model_config, self.model.shard
        self.kv_caches = new_kv_caches(shard.num_layers, num_blocks, self.block_size, shard.num_kv_heads,
                                       m.head_dim, m.dtype, self.config.cache.kv_cache_dtype == "int8", self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
                with_cache: bool = True) -> torch.Tensor:
        if with_cache and self.plan is not None and self.plan.covers(common):
            return self.plan(input_ids, positions, self.kv_caches, common)
        return self.model(input_ids, positions, self.kv_caches if with_cache else None,
                          self.attn.build_metadata(common), None)

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata) -> None:
        """The target's step over the same tokens and slots: only the K and V it writes matter."""
        self.forward(input_ids, positions, common)

    def propose(self, token_ids: list[list[int]], block_ids: list[list[int]], params: list[SamplingParams]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per request (its tokens, the newest last; its blocks; its sampling parameters): up to k drafts,
        none past max_model_len, and for a random request the draft's distributions they were drawn
        from ([n, vocab] float32; None for a greedy one)."""
        counts = [max(0, min(self.k, self.max_model_len - len(t))) for t in token_ids]
        drafts: list[list[int]] = [[] for _ in token_ids]
        probs: list[list[torch.Tensor]] = [[] for _ in token_ids]
        last = [t[-1] for t in token_ids]
        for step in range(max(counts, default=0)):
            # Rows longest context first, as the runner orders decodes.
            rows = sorted((i for i, n in enumerate(counts) if n > step), key=lambda i: -len(token_ids[i]))
            positions = np.array([len(token_ids[i]) - 1 + step for i in rows], dtype=np.int64)
            slots = np.concatenate([slots_of(positions[j:j + 1], block_ids[i], self.block_size)
                                    for j, i in enumerate(rows)])
            common = describe_batch(torch.from_numpy(slots).to(self.device), positions + 1,
                                    [block_ids[i] for i in rows], [], self.block_size, self.device)
            hidden = self.forward(torch.tensor([last[i] for i in rows], dtype=torch.long, device=self.device),
                                  torch.from_numpy(positions).to(self.device), common)
            logits = self.model.compute_logits(hidden).float()
            tokens, row_probs = self._draw(logits, [params[i] for i in rows], positions + 1)
            for j, i in enumerate(rows):
                drafts[i].append(tokens[j])
                last[i] = tokens[j]
                if row_probs[j] is not None:
                    probs[i].append(row_probs[j])
        return drafts, [torch.stack(p) if p else None for p in probs]

    @staticmethod
    def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: np.ndarray
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row: the argmax for greedy rows; for random ones a draw from the softmax
        at the row's temperature (seeded rows from their own generator), with that distribution."""
        tokens = logits.argmax(dim=-1).tolist()
        random = [j for j, p in enumerate(params) if p.sampling_type == SamplingType.RANDOM]
        row_probs: list[torch.Tensor | None] = [None] * len(params)
        if random:
            index = torch.tensor(random, dtype=torch.long, device=logits.device)
            temperature = torch.tensor([params[j].temperature for j in random], dtype=torch.float32,
                                       device=logits.device)
            q = (logits.index_select(0, index) / temperature.unsqueeze(1)).softmax(dim=-1)
            seeds = {r: seed_for_position(params[j].seed ^ _DRAFT_SEED_SALT, int(positions[j]))
                     for r, j in enumerate(random) if params[j].seed is not None}
            drawn = sample_by_exponential_race(q.clone(), seeds).tolist()
            for r, j in enumerate(random):
                tokens[j] = drawn[r]
                row_probs[j] = q[r]
        return tokens, row_probs
