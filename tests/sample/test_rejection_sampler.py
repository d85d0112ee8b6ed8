"""Speculative decoding (issue 19): the rejection sampler (kestrel/sample/rejection_sampler.py), its greedy
rule, and that its output is distributed as the target's whatever the drafts."""

from __future__ import annotations

import pytest
import torch

from kestrel.sample import SamplingMetadata
from kestrel.sample.rejection_sampler import RejectionSampler
from kestrel.sampling_params import SamplingParams

V = 8


def metadata_for(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingMetadata:
    outputs = outputs or [[] for _ in params]
    return SamplingMetadata.build(params, [[0]] * len(params), outputs, [None] * len(params), V,
                                  torch.device("cpu"))


def test_greedy_accepts_while_drafts_match_the_argmax():
    # Request 0: 3 drafts, argmax per row 5, 6, 1, 4; request 1: 1 draft, argmaxes 2, 3.
    argmaxes = [5, 6, 1, 4, 2, 3]
    logits = torch.full((6, V), -1.0)
    logits[torch.arange(6), torch.tensor(argmaxes)] = 3.0
    greedy = SamplingParams(temperature=0.0)
    out = RejectionSampler()(logits, metadata_for([greedy] * 6), [[5, 6, 7], [2]])
    # Request 0: drafts 5, 6 accepted, 7 rejected → the argmax 1 replaces it; request 1: all
    # accepted, then the bonus token 3.
    assert out.token_ids == [[5, 6, 1], [2, 3]]
    none_right = RejectionSampler()(logits, metadata_for([greedy] * 6), [[0, 6, 1], [2]])
    assert none_right.token_ids == [[5], [2, 3]]


def test_rows_without_drafts_sample_as_the_plain_sampler():
    logits = torch.randn(3, V)
    out = RejectionSampler()(logits, metadata_for([SamplingParams(temperature=0.0)] * 3), [[], [], []])
    assert out.token_ids == [[t] for t in logits.argmax(-1).tolist()]


def test_logprobs_follow_the_tokens_each_row_produced():
    logits = torch.randn(3, V)
    drafts = [logits[0].argmax().item(), (logits[1].argmax().item() + 1) % V]  # accepted, then rejected
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = RejectionSampler()(logits, metadata_for([params] * 3), [drafts])
    assert out.token_ids == [[drafts[0], logits[1].argmax().item()]]
    raw = logits.log_softmax(-1)
    for row, token in enumerate(out.token_ids[0]):
        assert out.logprob_token_ids[row, 0] == token
        assert out.logprobs[row, 0] == pytest.approx(raw[row, token].item())


def chi_squared_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs` (cells of zero probability must be
    empty)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability zero was drawn"
    expected = probs[keep].double() * counts.sum()
    statistic = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


@pytest.mark.parametrize("draft", ["argmax", "unlikely", "impossible", "draft-model"])
def test_first_token_is_distributed_as_the_target_whatever_the_draft(draft):
    """Accept with min(1, p/q), else draw from max(0, p - q): the first token's distribution is p."""
    torch.manual_seed(0)
    target_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, float("-inf")])
    p = target_logits.softmax(-1)
    n = 20000
    logits = target_logits.repeat(2 * n, 1)  # row 0 of each request verifies its draft, row 1 follows
    draft_token = {"argmax": 0, "unlikely": 6, "impossible": 7, "draft-model": 0}[draft]
    draft_probs = None
    if draft == "draft-model":  # a draft model that disagrees: q puts most mass where p has little
        q = torch.tensor([0.05, 0.05, 0.05, 0.05, 0.1, 0.2, 0.5, 0.0])
        draft_tokens = torch.multinomial(q, n, replacement=True)
        draft_probs = q.repeat(n, 1)
        drafts = [[t] for t in draft_tokens.tolist()]
    else:
        drafts = [[draft_token]] * n
    params = SamplingParams(temperature=1.0)
    out = RejectionSampler()(logits, metadata_for([params] * (2 * n)), drafts, draft_probs)
    first = torch.tensor([t[0] for t in out.token_ids])
    counts = torch.bincount(first, minlength=V)
    assert chi_squared_p(counts, p) > 1e-3, (counts, p * n)
    accepted = sum(len(t) == 2 for t in out.token_ids) / n
    if draft == "argmax":
        assert accepted == pytest.approx(p[0].item(), abs=0.02)
    if draft == "impossible":
        assert accepted == 0


def test_sampling_filters_hold_on_verified_rows():
    """top_k=2: only the two most likely tokens ever come out, accepted drafts or not."""
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).repeat(2 * 500, 1)
    params = SamplingParams(temperature=1.0, top_k=2)
    out = RejectionSampler()(logits, metadata_for([params] * 1000), [[4]] * 500)  # a draft top_k excludes
    assert {t for tokens in out.token_ids for t in tokens} <= {0, 1}
    assert all(len(t) == 1 for t in out.token_ids)  # p(4) = 0 after top_k: never accepted


def test_bad_words_logit_bias_and_allowed_token_ids_hold_on_verified_rows():
    """Each verified row is prepared with the drafts before it counted as output: a draft that
    completes a bad word is rejected, and logit_bias and allowed_token_ids apply to every row."""
    logits = torch.full((3, V), 0.0)
    logits[:, 5] = 3.0  # the target's argmax everywhere: 5
    greedy = SamplingParams(temperature=0.0)
    # Drafts 5, 5: the second completes the bad word [5, 5] → rejected, the best other token (0) replaces it.
    # (The model runner builds row j's output as the known output plus drafts[:j].)
    out = RejectionSampler()(logits, metadata_for([greedy.clone(bad_words_token_ids=[[5, 5]])] * 3,
                                                  [[], [5], [5, 5]]), [[5, 5]])
    assert out.token_ids == [[5, 0]]
    out = RejectionSampler()(logits, metadata_for([greedy.clone(logit_bias={2: 10.0})] * 3), [[2, 5]])
    assert out.token_ids == [[2, 2]]
    out = RejectionSampler()(logits, metadata_for([greedy.clone(allowed_token_ids=[1, 3])] * 3), [[1, 5]])
    assert out.token_ids == [[1, 1]]
    # Random rows: the banned token is never accepted nor drawn.
    params = SamplingParams(temperature=1.0, bad_words_token_ids=[[4]], allowed_token_ids=[3, 4, 6])
    logits = torch.zeros(2 * 300, V)
    out = RejectionSampler()(logits, metadata_for([params] * 600), [[4]] * 300)
    assert {t for tokens in out.token_ids for t in tokens} <= {3, 6}


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = RejectionSampler()(logits[:2], metadata_for([seeded] * 2, [[], [3]]), [[3]])
    other = SamplingParams(temperature=0.7)
    mixed = RejectionSampler()(torch.cat([logits[2:], logits[:2]]),
                               metadata_for([other, other, seeded, seeded], [[], [1], [], [3]]), [[1], [3]])
    assert mixed.token_ids[1] == alone.token_ids[0]
