"""Tests of the vectorized sampler (kestrel.sample)."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.sample import Sampler, SamplerOutput, SamplingMetadata
from kestrel.sample.sampler import (
    RANDOM_ROWS_AT_A_TIME,
    TOP_CANDIDATES,
    apply_penalties,
    apply_top_k_top_p,
    top_k_top_p_among_candidates,
    top_k_top_p_by_sort,
)
from kestrel.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def build_metadata(params: list[SamplingParams], vocab_size: int,
                   outputs: list[list[int]] | None = None,
                   prompts: list[list[int]] | None = None,
                   eos: list[int | None] | None = None) -> SamplingMetadata:
    rows = len(params)
    return SamplingMetadata.build(params, prompts or [[] for _ in range(rows)],
                                  outputs or [[] for _ in range(rows)],
                                  eos or [None] * rows, vocab_size, CPU)


def run_sampler(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> SamplerOutput:
    return Sampler()(logits, build_metadata(params, logits.shape[-1], **kwargs))


def logits_from_probs(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


def assert_frequencies_match(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Each token's frequency within 5 standard errors of its probability (the seed is fixed, so
    this is deterministic; 5 sigma keeps it robust to any change of draw order)."""
    draws = tokens.numel()
    observed = torch.bincount(tokens, minlength=expected.numel()).double() / draws
    expected = expected.double()
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert torch.all((observed - expected).abs() <= 5 * sigma + 1e-9), (observed, expected)


# ------------------------------------------------------------------------------------------
# metadata
# ------------------------------------------------------------------------------------------


def test_metadata_skips_settings_no_row_uses():
    md = build_metadata([GREEDY, SamplingParams(temperature=0.0, top_k=5, top_p=0.5)], 10)
    assert md.all_greedy and not md.all_random
    assert md.temperature is None and md.greedy_mask is None
    # Filters of greedy rows are irrelevant.
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.output_token_ids is None and md.prompt_token_ids is None
    assert md.min_tokens_rows is None and md.max_num_logprobs is None
    assert md.row_seeds == {}


def test_metadata_per_row_values():
    params = [GREEDY,
              SamplingParams(temperature=0.5, top_k=3, seed=7, logprobs=2),
              SamplingParams(top_k=100, top_p=0.9, frequency_penalty=0.5, logprobs=5)]
    md = build_metadata(params, 10, outputs=[[], [1, 2], [3, 3, 3]])
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask.tolist() == [True, False, False]
    assert md.temperature.tolist() == [1.0, 0.5, 1.0]
    assert md.top_k.tolist() == [10, 3, 10]  # disabled rows and k > V both mean the whole vocab
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert md.min_p is None
    assert set(md.row_seeds) == {1}
    assert not md.no_penalties
    assert md.presence_penalties is None and md.repetition_penalties is None
    assert md.frequency_penalties.tolist() == [0.0, 0.0, 0.5]
    assert md.output_token_ids.tolist() == [[10, 10, 10], [1, 2, 10], [3, 3, 3]]
    assert md.prompt_token_ids is None  # only a repetition penalty reads the prompt
    assert md.max_num_logprobs == 5


# ------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_and_leaves_inputs_and_rng_alone(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 50).to(dtype)
    before = logits.clone()
    rng_before = torch.random.get_rng_state()

    out = run_sampler(logits, [GREEDY] * 6)

    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
    assert torch.equal(logits, before)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # no random draw at all


def test_greedy_with_penalties_or_min_tokens_leaves_the_callers_logits_alone():
    """Greedy rows whose logits are changed first (a penalty, min_tokens) work on a copy; only a
    batch that changes nothing reads the caller's float32 tensor as it is."""
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    before = logits.clone()
    top2 = before.topk(2, dim=-1).indices
    best, second = top2[:, 0].tolist(), top2[:, 1].tolist()
    # A large frequency penalty on each row's best token: the second best wins.
    out = run_sampler(logits, [SamplingParams(temperature=0.0, frequency_penalty=100.0)] * 2,
                      outputs=[[b] for b in best])
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.tolist() == second
    # min_tokens masks EOS (here each row's best token) until reached: the second best wins.
    out = run_sampler(logits, [SamplingParams(temperature=0.0, min_tokens=3)] * 2, eos=best)
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.tolist() == second


def test_greedy_ties_pick_lowest_index():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert run_sampler(logits, [GREEDY]).sampled_token_ids.tolist() == [1]


def test_mixed_batch_keeps_greedy_rows_exact():
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    params = [GREEDY if row % 2 == 0 else
              SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.01)
              for row in range(8)]
    allowed = logits.topk(5, dim=-1).indices
    for _ in range(20):
        tokens = run_sampler(logits, params).sampled_token_ids
        assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))
        for row in range(1, 8, 2):
            assert tokens[row] in allowed[row]


# ------------------------------------------------------------------------------------------
# seeds
# ------------------------------------------------------------------------------------------


def test_seeded_row_same_alone_and_in_any_batch():
    torch.manual_seed(2)
    row_logits = torch.randn(1, 64)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    others = [SamplingParams(temperature=0.8, top_k=10), GREEDY,
              SamplingParams(temperature=1.2, top_p=0.5, seed=99)]
    tokens_by_position = []
    for position in range(30):
        torch.manual_seed(position)  # the global generator must not matter
        alone = run_sampler(row_logits, [seeded], outputs=[[0] * position])
        torch.manual_seed(1000 + position)
        batch_logits = torch.cat([torch.randn(1, 64), torch.randn(1, 64), row_logits,
                                  torch.randn(1, 64)])
        # Same position, different earlier tokens: as after a preemption and resume.
        batched = run_sampler(batch_logits, [others[0], others[1], seeded, others[2]],
                              outputs=[[1], [], [5] * position, [2, 3]])
        assert alone.sampled_token_ids[0] == batched.sampled_token_ids[2]
        tokens_by_position.append(int(alone.sampled_token_ids[0]))
    assert len(set(tokens_by_position)) > 5  # each position gets its own draw


def test_seeded_rows_far_into_a_large_batch_draw_as_alone():
    """Large batches are drawn a slice of rows at a time (RANDOM_ROWS_AT_A_TIME): each seeded row, in
    whichever slice, keeps its own filters and its own draw."""
    torch.manual_seed(5)
    rows = 3 * RANDOM_ROWS_AT_A_TIME + 5
    logits = torch.randn(rows, 64)
    settings = [dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.5), dict(min_p=0.1),
                dict(temperature=0.0), dict(temperature=0.3)]   # 5: no slice starts on the same setting
    params = [SamplingParams(**settings[row % 5], seed=row) if row % 3 == 0 else SamplingParams(**settings[row % 5])
              for row in range(rows)]
    batched = run_sampler(logits, params, outputs=[[1] * (row % 7) for row in range(rows)]).sampled_token_ids
    for row in range(0, rows, 3):
        alone = run_sampler(logits[row:row + 1], [params[row]], outputs=[[2] * (row % 7)]).sampled_token_ids
        assert alone[0] == batched[row], row


def test_different_seeds_give_different_draws():
    logits = torch.zeros(2, 16)  # uniform
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    differing = 0
    for position in range(50):
        tokens = run_sampler(logits, params, outputs=[[0] * position] * 2).sampled_token_ids
        differing += int(tokens[0] != tokens[1])
    assert differing >= 30  # about 47 expected for independent uniform draws


def test_all_seeded_batch_leaves_global_rng_alone():
    rng_before = torch.random.get_rng_state()
    run_sampler(torch.zeros(3, 8), [SamplingParams(seed=s) for s in range(3)])
    assert torch.equal(torch.random.get_rng_state(), rng_before)


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.05, 0.3, 0.1, 0.2, 0.35])
    draws = 4000
    params = [SamplingParams(seed=seed) for seed in range(draws)]
    tokens = run_sampler(logits_from_probs(probs.tolist(), draws), params).sampled_token_ids
    assert_frequencies_match(tokens, probs)


# ------------------------------------------------------------------------------------------
# filters and temperature
# ------------------------------------------------------------------------------------------

# Token ids sorted by probability: 1 (0.4), 3 (0.25), 5 (0.15), 4 (0.1), 0 (0.05), 6 (0.03), 2.
FILTER_PROBS = [0.05, 0.4, 0.02, 0.25, 0.1, 0.15, 0.03]


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=3), {1, 3, 5}),
    (SamplingParams(top_k=1), {1}),
    # Kept while the more likely tokens hold < top_p: 0.4 and 0.65 ≥ 0.6 stops before token 5.
    (SamplingParams(top_p=0.6), {1, 3}),
    (SamplingParams(top_p=0.7), {1, 3, 5}),
    (SamplingParams(top_p=0.01), {1}),
    # min_p 0.2 × max 0.4 = 0.08 → 0.05 and below are dropped.
    (SamplingParams(min_p=0.2), {1, 3, 4, 5}),
    # top_k 4 renormalizes to 0.44, 0.28, 0.17, 0.11; top_p 0.6 then keeps two.
    (SamplingParams(top_k=4, top_p=0.6), {1, 3}),
    # Filters act after temperature: at T = 0.25, 0.25 / 0.4 → (0.625)^4 ≈ 0.15 of the max.
    (SamplingParams(temperature=0.25, min_p=0.2), {1}),
    (SamplingParams(temperature=4.0, min_p=0.2), {0, 1, 2, 3, 4, 5, 6}),
])
def test_filters_never_emit_excluded_tokens(params, allowed):
    torch.manual_seed(3)
    draws = 2000
    out = run_sampler(logits_from_probs(FILTER_PROBS, draws), [params] * draws)
    assert set(out.sampled_token_ids.tolist()) == allowed


def test_filters_apply_per_row_in_one_batch():
    torch.manual_seed(4)
    per_setting = 1000
    settings = [(SamplingParams(top_k=2), {1, 3}),
                (SamplingParams(top_p=0.7), {1, 3, 5}),
                (SamplingParams(min_p=0.2), {1, 3, 4, 5}),
                (GREEDY, {1}),
                (SamplingParams(), set(range(7)))]
    params = [p for p, _ in settings for _ in range(per_setting)]
    tokens = run_sampler(logits_from_probs(FILTER_PROBS, len(params)), params).sampled_token_ids
    for index, (_, allowed) in enumerate(settings):
        chunk = tokens[index * per_setting:(index + 1) * per_setting]
        assert set(chunk.tolist()) == allowed


def test_top_k_top_p_among_candidates_keeps_what_the_sort_keeps():
    """Past TOP_CANDIDATES tokens a row is filtered among its most likely ones when its set lies there,
    by the whole sort otherwise (top_k above it, or so flat a distribution that top_p's mass is not
    reached within it); either way the kept tokens are the sort's."""
    torch.manual_seed(6)
    vocab = 3 * TOP_CANDIDATES + 7
    top_ks = [5, 50, TOP_CANDIDATES, TOP_CANDIDATES + 1, 2 * TOP_CANDIDATES, vocab]
    top_ps = [0.3, 0.9, 0.99, 1.0]
    settings = [(k, p) for k in top_ks for p in top_ps]
    scales = [4.0 if row % 3 else 0.01 for row in range(len(settings))]   # every third row nearly flat
    logits = torch.randn(len(settings), vocab) * torch.tensor(scales).unsqueeze(1)
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    done = top_k_top_p_among_candidates(logits.clone(), top_k, top_p)
    assert done.any() and not done.all()   # both ways are taken
    filtered = apply_top_k_top_p(logits.clone(), top_k, top_p)
    by_sort = top_k_top_p_by_sort(logits.clone(), top_k, top_p)
    assert torch.equal(filtered.isinf(), by_sort.isinf())
    assert torch.equal(filtered[~filtered.isinf()], logits[~filtered.isinf()])
    assert (~filtered.isinf()).sum(dim=-1).min() >= 1


def test_frequencies_match_softmax_at_temperature():
    torch.manual_seed(5)
    row = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.8, -0.4, 1.5, -2.0])
    temperature, draws = 0.7, 20_000
    tokens = run_sampler(row.expand(draws, -1).contiguous(),
                         [SamplingParams(temperature=temperature)] * draws).sampled_token_ids
    assert_frequencies_match(tokens, torch.softmax(row / temperature, dim=-1))


def test_frequencies_after_top_k_are_renormalized():
    torch.manual_seed(6)
    draws = 20_000
    tokens = run_sampler(logits_from_probs(FILTER_PROBS, draws),
                         [SamplingParams(top_k=3)] * draws).sampled_token_ids
    expected = torch.zeros(7)
    expected[[1, 3, 5]] = torch.tensor([0.4, 0.25, 0.15]) / 0.8
    assert_frequencies_match(tokens, expected)


# ------------------------------------------------------------------------------------------
# penalties
# ------------------------------------------------------------------------------------------


def test_apply_penalties_follows_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    md = build_metadata(params, 5, prompts=[[0, 1], [0, 1]], outputs=[[3, 3, 4], [3, 3, 4]])
    apply_penalties(logits, md)
    # token 0: prompt, 2/2 = 1. token 1: prompt, -1*2 = -2. token 2: unseen.
    # token 3: 3/2 = 1.5, twice in the output: - 2*0.5 - 0.25 = 0.25.
    # token 4: -2*2 = -4, once: - 0.5 - 0.25 = -4.75.
    assert logits[0].tolist() == pytest.approx([1.0, -2.0, 0.5, 0.25, -4.75])
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]


def test_penalties_change_the_greedy_choice():
    cases = [  # (logits, params, prompt, output, expected token)
        ([2.0, 1.5, 0.0], dict(repetition_penalty=1.5), [0], [], 1),     # 2/1.5 = 1.33 < 1.5
        ([2.0, 1.5, 0.0], dict(repetition_penalty=1.2), [0], [], 0),     # 2/1.2 = 1.67 > 1.5
        ([-1.0, -1.5, -3.0], dict(repetition_penalty=2.0), [], [0], 1),  # -1*2 = -2 < -1.5
        ([-1.0, -1.5, -3.0], dict(repetition_penalty=1.4), [], [0], 0),  # -1.4 > -1.5
        ([3.0, 2.5, 0.0], dict(frequency_penalty=0.2), [], [0, 0, 0], 1),  # 3 - 0.6 = 2.4
        ([3.0, 2.5, 0.0], dict(frequency_penalty=0.1), [], [0, 0, 0], 0),  # 3 - 0.3 = 2.7
        ([3.0, 2.5, 0.0], dict(presence_penalty=0.4), [], [0, 0, 0], 0),   # 3 - 0.4 = 2.6
        ([3.0, 2.5, 0.0], dict(presence_penalty=0.6), [], [0, 0, 0], 1),   # 3 - 0.6 = 2.4
        # Frequency and presence look at the output only, never the prompt.
        ([3.0, 2.5, 0.0], dict(frequency_penalty=2.0, presence_penalty=2.0), [0, 0, 0], [], 0),
        ([2.5, 3.0, 0.0], dict(presence_penalty=-1.0), [], [0], 0),        # 2.5 + 1 = 3.5
        ([3.0, 2.5, 0.0], {}, [0], [0, 0], 0),
    ]
    logits = torch.tensor([c[0] for c in cases])
    params = [SamplingParams(temperature=0.0, **c[1]) for c in cases]
    out = run_sampler(logits, params, prompts=[c[2] for c in cases],
                      outputs=[c[3] for c in cases])
    assert out.sampled_token_ids.tolist() == [c[4] for c in cases]


# ------------------------------------------------------------------------------------------
# min_tokens
# ------------------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 2, 3
    row = [0.0, 1.0, 5.0, 4.0, 3.0, 2.0]  # EOS best, then the stop id, then token 4
    with_min = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    cases = [  # (params, output length, eos id, expected token)
        (with_min, 0, eos, 4),
        (with_min, 2, eos, 4),
        (with_min, 3, eos, eos),   # reached: nothing masked
        (with_min, 7, eos, eos),
        (with_min, 1, None, eos),  # no EOS id known: only the stop id is masked
        (with_min.clone(stop_token_ids=[]), 1, eos, stop),
        (with_min.clone(ignore_eos=True), 1, eos, 4),  # EOS still masked, as in vLLM
        (SamplingParams(temperature=0.0, stop_token_ids=[stop]), 0, eos, eos),
    ]
    out = run_sampler(torch.tensor([row] * len(cases)), [c[0] for c in cases],
                      outputs=[[1] * c[1] for c in cases], eos=[c[2] for c in cases])
    assert out.sampled_token_ids.tolist() == [c[3] for c in cases]


def test_min_tokens_applies_to_random_rows():
    torch.manual_seed(7)
    draws = 500
    params = SamplingParams(min_tokens=1, stop_token_ids=[0])
    out = run_sampler(torch.zeros(draws, 4), [params] * draws, eos=[3] * draws)
    assert set(out.sampled_token_ids.tolist()) == {1, 2}


# ------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------


def test_logprobs_are_raw_with_sampled_token_first_and_ranks():
    torch.manual_seed(8)
    logits = torch.randn(5, 30)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=2.0),  # no logprobs asked: still gets columns
              SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=2.0),
              SamplingParams(temperature=1.0, top_k=10, seed=3, logprobs=1)]
    outputs = [[], [4, 5], [], [int(logits[3].argmax())] * 2, []]
    out = run_sampler(logits.to(torch.bfloat16), params, outputs=outputs, prompts=[[1, 2]] * 5)

    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == (5, 6) and out.logprob_token_ids.dtype == torch.int64
    assert out.logprobs.shape == (5, 6) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert torch.all(out.logprobs[:, 1:-1] >= out.logprobs[:, 2:])  # descending
    # Rank: 1 + the number of tokens strictly more likely than the sampled one.
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = [order[row].tolist().index(int(sampled[row])) + 1 for row in range(5)]
    assert out.sampled_ranks.tolist() == expected_ranks
    assert out.sampled_ranks[0] == 1  # plain greedy takes the most likely token
    assert out.sampled_ranks[3] > 1   # the penalty moved greedy off the raw argmax


def test_logprobs_raw_even_with_min_tokens_mask():
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    params = [SamplingParams(temperature=0.0, min_tokens=1, logprobs=1)]
    out = run_sampler(logits, params, eos=[2])
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.sampled_token_ids.tolist() == [1]
    assert out.logprob_token_ids.tolist() == [[1, 2]]
    assert out.logprobs[0].tolist() == pytest.approx([float(raw[1]), float(raw[2])])
    assert out.sampled_ranks.tolist() == [2]
    assert math.isfinite(out.logprobs[0, 1])


# ------------------------------------------------------------------------------------------
# allowed_token_ids, bad words, logit bias (issue 21)
# ------------------------------------------------------------------------------------------


def test_a_batch_without_the_logits_settings_builds_and_copies_nothing(monkeypatch):
    md = build_metadata([GREEDY, SamplingParams(temperature=0.0, stop_token_ids=[3])], 10)
    assert md.allowed_rows is None and md.disallowed_mask is None
    assert md.bad_words_rows is None and md.bad_words_token_ids is None
    assert md.logit_bias_rows is None and md.logit_bias_token_ids is None and md.logit_bias_values is None
    assert not md.changes_logits
    # The caller's float32 logits are read as they are: no copy, and none of the steps runs.
    from kestrel.sample import sampler as sampler_module
    seen = []
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda *a, **k: seen.append("index_put_"))
    logits = torch.randn(2, 10)
    prepared, _ = sampler_module.prepare_logits(logits, md)
    assert prepared.data_ptr() == logits.data_ptr() and seen == []
    # A bad word whose prefix the output does not end with asks nothing of this step either.
    md = build_metadata([GREEDY.clone(bad_words_token_ids=[[4, 5]])], 10, outputs=[[1, 2]])
    assert md.bad_words_rows is None and not md.changes_logits


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 20)
    before = logits.clone()
    allowed = [3, 7, 11]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed), GREEDY,
              SamplingParams(temperature=1.0, allowed_token_ids=[5]),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed)]
    md = build_metadata(params, 20)
    assert md.allowed_rows.tolist() == [0, 2, 3] and md.disallowed_mask.shape == (3, 20)
    for _ in range(20):
        out = Sampler()(logits, md).sampled_token_ids.tolist()
        assert out[0] == allowed[int(before[0, allowed].argmax())]
        assert out[1] == int(before[1].argmax())  # the row without the setting is untouched
        assert out[2] == 5 and out[3] in allowed
    assert torch.equal(logits, before)


def test_allowed_token_ids_keep_the_relative_probabilities():
    torch.manual_seed(3)
    draws = 4000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = run_sampler(logits_from_probs(probs.tolist(), draws),
                      [SamplingParams(allowed_token_ids=[1, 3])] * draws)
    assert_frequencies_match(out.sampled_token_ids, torch.tensor([0.0, 1 / 3, 0.0, 2 / 3]))


def test_bad_words_ban_the_last_token_after_a_matching_prefix():
    row = [0.0, 1.0, 2.0, 3.0, 9.0, 8.0, 7.0]  # 4 best, then 5, then 6
    single = SamplingParams(temperature=0.0, bad_words_token_ids=[[4]])
    double = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2, 4], [3, 5]])
    cases = [  # (params, output, expected token)
        (single, [], 5),            # a one-token word is always banned
        (single, [4, 4], 5),
        (double, [], 4),            # no prefix generated yet
        (double, [1, 2], 5),        # 1 2 → 4 banned
        (double, [2, 1, 2], 5),
        (double, [1, 3], 4),        # the prefix must be the output's tail
        (double, [1, 2, 3], 4),     # 3 → 5 banned, and 4 allowed again (the tail is 2 3)
        (GREEDY, [1, 2], 4),
    ]
    out = run_sampler(torch.tensor([row] * len(cases)), [c[0] for c in cases], outputs=[c[1] for c in cases])
    assert out.sampled_token_ids.tolist() == [c[2] for c in cases]


def test_bad_words_on_random_rows_never_sample_the_banned_token():
    torch.manual_seed(5)
    draws = 500
    params = SamplingParams(bad_words_token_ids=[[7, 1], [2]])
    out = run_sampler(torch.zeros(draws, 4), [params] * draws, outputs=[[7]] * draws)
    assert set(out.sampled_token_ids.tolist()) == {0, 3}


def test_logit_bias_adds_to_the_logits_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    params = [SamplingParams(temperature=0.0, logit_bias={0: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={"3": -100, "1": 2.5}),  # OpenAI's string keys
              GREEDY]
    md = build_metadata(params, 4)
    assert md.logit_bias_rows.tolist() == [0, 1, 1] and md.logit_bias_token_ids.tolist() == [0, 3, 1]
    assert md.logit_bias_values.tolist() == [100.0, -100.0, 2.5]
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 1, 3]
    # The biased logits themselves: +bias on the named tokens only.
    from kestrel.sample.sampler import prepare_logits
    prepared, _ = prepare_logits(logits, md)
    assert prepared[1].tolist() == [0.0, 3.5, 2.0, -97.0]
    assert torch.equal(prepared[2], logits[2])


def test_logit_bias_shifts_random_draws():
    torch.manual_seed(9)
    draws = 4000
    # Uniform over 4 tokens, token 2 biased by log(3): probabilities 1/6, 1/6, 1/2, 1/6.
    out = run_sampler(torch.zeros(draws, 4), [SamplingParams(logit_bias={2: math.log(3)})] * draws)
    assert_frequencies_match(out.sampled_token_ids, torch.tensor([1 / 6, 1 / 6, 1 / 2, 1 / 6]))


def test_logit_bias_is_clamped_and_checked():
    assert SamplingParams(logit_bias={"5": 1000, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"five": 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0}).validate()
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[]).validate()
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "]).validate()
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2).validate()
    for field, params in (("logit_bias", SamplingParams(logit_bias={10: 1.0})),
                          ("allowed_token_ids", SamplingParams(allowed_token_ids=[1, 10])),
                          ("bad_words", SamplingParams(bad_words=["x"], bad_words_token_ids=[[1, 10]]))):
        params.validate()
        params.validate_vocab(11)
        with pytest.raises(ValueError, match=f"^{field} has token ids out of range.*\\[10\\]"):
            params.validate_vocab(10)


def test_order_allowed_then_bad_words_then_bias_then_min_tokens_and_raw_logprobs():
    """Every setting at once on one row, and the logprobs stay the model's."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[0, 1, 2, 3],  # 4, 5 out
                            bad_words_token_ids=[[1]],       # 1 out
                            logit_bias={3: 1.5, 4: 100.0},   # 3 → 3.5; 4 stays out
                            min_tokens=1)                    # EOS (0) out
    out = run_sampler(logits, [params], eos=[0])
    assert out.sampled_token_ids.tolist() == [3]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.logprobs[0].tolist() == pytest.approx([float(raw[3]), float(raw[0])])
