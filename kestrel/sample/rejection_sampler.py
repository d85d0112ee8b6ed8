"""Verifying draft tokens: the target model's logits at every drafted position → the accepted drafts
and one more token per request, distributed exactly as the target model alone would sample them.

A request with k drafts has k + 1 consecutive logits rows: row j (j < k) is the target's
distribution for the position of draft j, row k the one after the last draft. Every row is prepared
as the plain sampler prepares its row (allowed_token_ids, bad words, logit bias, min_tokens, penalties,
temperature, min_p, top_k, top_p), with the drafts before it counted as output tokens, so each sampling
parameter keeps its meaning (a draft that would complete a bad word is rejected).

- Greedy rows accept draft j while it is the target's argmax; the first mismatch is replaced by the
  argmax, and after k accepted drafts the argmax of row k follows them: the same tokens as without
  speculation.
- Random rows accept draft j with probability min(1, p(d) / q(d)), p the target's distribution and q
  the draft's (one-hot for drafts that are looked up rather than sampled, such as n-gram ones); at
  the first rejection they draw from max(0, p - q), normalised; after k accepted drafts they draw
  from row k. That is the speculative sampling of Leviathan et al. and Chen et al. (2023): the output
  is distributed as the target's, whatever the drafts.

Seeded rows draw from generators seeded by (seed, output position) alone, as in the plain sampler, so
a seeded request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.ops.dispatch import Argmax, argmax_reference
from kestrel.sample.metadata import SamplingMetadata
from kestrel.sample.sampler import gather_logprobs, prepare_logits, random_probs, sample_by_exponential_race

# Acceptance draws of a seeded row use a generator seeded apart from the one its token draw uses.
_ACCEPT_SEED_SALT = 0x5EED_ACCE


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]               # per request: its accepted drafts, then one more token
    # Per row, as `SamplerOutput`'s: the row's output token first (rows after a rejection: any token).
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    sampled_ranks: torch.Tensor | None


class RejectionSampler:
    def __init__(self, argmax_rows: Argmax = argmax_reference) -> None:
        self.argmax_rows = argmax_rows

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: list[list[int]],
                 draft_probs: torch.Tensor | None = None) -> RejectionSamplerOutput:
        """`logits` [sum(k_i + 1), V], requests' rows consecutive; `metadata` per row; `draft_probs`
        [sum(k_i), V] the draft model's distributions, or None for one-hot drafts."""
        assert logits.shape[0] == sum(len(d) + 1 for d in draft_token_ids), (logits.shape, draft_token_ids)
        device = logits.device
        logits, raw_logprobs = prepare_logits(logits, metadata)
        first_rows = _first_rows(draft_token_ids)
        draft_rows = torch.tensor([f + j for f, d in zip(first_rows, draft_token_ids) for j in range(len(d))],
                                  dtype=torch.long, device=device)
        bonus_rows = torch.tensor([f + len(d) for f, d in zip(first_rows, draft_token_ids)],
                                  dtype=torch.long, device=device)
        drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)

        greedy_rows = self._greedy_rows(metadata, logits.shape[0], device)
        argmax = None if metadata.all_random else self.argmax_rows(logits)
        accepted = recovered = bonus = None
        if argmax is not None:
            accepted, recovered, bonus = argmax[draft_rows] == drafts, argmax[draft_rows], argmax[bonus_rows]
        if not metadata.all_greedy:
            probs = random_probs(logits, metadata)
            r_accepted, r_recovered, r_bonus = self._sample_random(probs, metadata.row_seeds, draft_rows, drafts,
                                                                   bonus_rows, draft_probs)
            if argmax is None:
                accepted, recovered, bonus = r_accepted, r_recovered, r_bonus
            else:
                g_draft, g_bonus = greedy_rows[draft_rows], greedy_rows[bonus_rows]
                accepted = torch.where(g_draft, accepted, r_accepted)
                recovered = torch.where(g_draft, recovered, r_recovered)
                bonus = torch.where(g_bonus, bonus, r_bonus)

        token_ids, row_tokens = _walk(draft_token_ids, accepted.tolist(), recovered.tolist(), bonus.tolist())
        if raw_logprobs is None:
            return RejectionSamplerOutput(token_ids, None, None, None)
        ids, lps, ranks = gather_logprobs(raw_logprobs, torch.tensor(row_tokens, dtype=torch.long, device=device),
                                          metadata.max_num_logprobs)
        return RejectionSamplerOutput(token_ids, ids, lps, ranks)

    @staticmethod
    def _greedy_rows(metadata: SamplingMetadata, num_rows: int, device: torch.device) -> torch.Tensor:
        if metadata.greedy_mask is not None:
            return metadata.greedy_mask
        return torch.full((num_rows,), metadata.all_greedy, dtype=torch.bool, device=device)

    def _sample_random(self, probs: torch.Tensor, row_seeds: dict[int, int], draft_rows: torch.Tensor,
                       drafts: torch.Tensor, bonus_rows: torch.Tensor, draft_probs: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(accepted per draft, the draw from the residual per draft, the draw from the bonus row)."""
        bonus = sample_by_exponential_race(probs[bonus_rows], _local_seeds(bonus_rows.tolist(), row_seeds),
                                           self.argmax_rows)
        if not len(draft_rows):
            return torch.zeros(0, dtype=torch.bool, device=probs.device), drafts, bonus
        p = probs[draft_rows]
        p_draft = p.gather(1, drafts.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            accept_prob = p_draft
            residual = p.scatter(1, drafts.unsqueeze(1), 0.0)
        else:
            q_draft = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
            accept_prob = (p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)).clamp_max(1.0)
            residual = (p - draft_probs).clamp_min_(0.0)
        # p == q leaves nothing to draw from; a rejection is then (almost) impossible, and p is the answer.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)

        draft_list = draft_rows.tolist()
        uniform = torch.rand(len(draft_list), device=probs.device)
        for i, row in enumerate(draft_list):
            if row in row_seeds:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(row_seeds[row] ^ _ACCEPT_SEED_SALT)
                uniform[i] = torch.rand(1, generator=generator, device=probs.device)
        accepted = uniform < accept_prob
        recovered = sample_by_exponential_race(residual, _local_seeds(draft_list, row_seeds), self.argmax_rows)
        return accepted, recovered, bonus


def _first_rows(draft_token_ids: list[list[int]]) -> list[int]:
    rows, at = [], 0
    for drafts in draft_token_ids:
        rows.append(at)
        at += len(drafts) + 1
    return rows


def _local_seeds(rows: list[int], row_seeds: dict[int, int]) -> dict[int, int]:
    return {i: row_seeds[row] for i, row in enumerate(rows) if row in row_seeds}


def _walk(draft_token_ids: list[list[int]], accepted: list[bool], recovered: list[int],
          bonus: list[int]) -> tuple[list[list[int]], list[int]]:
    """(per request: the drafts up to the first rejection, then its replacement or the bonus token;
    per row: the token that row produced, its draft where nothing was produced)."""
    token_ids: list[list[int]] = []
    row_tokens: list[int] = []
    at = 0
    for i, drafts in enumerate(draft_token_ids):
        out: list[int] = []
        for j, draft in enumerate(drafts):
            if not accepted[at + j]:
                out.append(recovered[at + j])
                break
            out.append(draft)
        else:
            out.append(bonus[i])
        padding = drafts + [bonus[i]]
        row_tokens.extend(out + padding[len(out):])
        token_ids.append(out)
        at += len(drafts)
    return token_ids, row_tokens
