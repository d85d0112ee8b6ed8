"""Speculative decoding (issue 19), the parts without a model: the n-gram proposer, the rejection
sampler (greedy rule, and that its output is distributed as the target's whatever the drafts), the
configuration, and the scheduler's budgeting and roll-back of draft tokens."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import SchedulerConfig, SpeculativeConfig
from kestrel.core.block_pool import hash_block_tokens
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.scheduler import Scheduler
from kestrel.engine.arg_utils import speculative_config
from kestrel.messages import ModelRunnerOutput
from kestrel.sample import SamplingMetadata
from kestrel.sample.rejection_sampler import RejectionSampler
from kestrel.sampling_params import SamplingParams
from kestrel.worker.spec_decode import NgramProposer

# ---- the n-gram proposer ----------------------------------------------------------------------------


def ngram(k: int = 3, max_n: int = 3, min_n: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=max_n, prompt_lookup_min=min_n))


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0 (then 9 9 1) and at 5 (then 7 8 5): the latest wins.
    assert ngram(k=3).propose(tokens) == [7, 8, 5]
    assert ngram(k=1).propose(tokens) == [7]


def test_ngram_prefers_the_longest_match_and_stops_at_min():
    # The last 2-gram "4 5" occurs at 0 (then 6); the last 1-gram "5" occurs later, at 4 (then 8).
    tokens = [4, 5, 6, 0, 5, 8, 4, 5]
    assert ngram(k=1, max_n=2, min_n=1).propose(tokens) == [6]
    assert ngram(k=1, max_n=1, min_n=1).propose(tokens) == [8]
    assert ngram(k=1, max_n=3, min_n=3).propose(tokens) == []   # "6 4 5"... no 3-gram recurs


def test_ngram_drafts_are_cut_at_the_end_of_the_context():
    assert ngram(k=4, max_n=2, min_n=2).propose([1, 2, 1, 2]) == [1, 2]
    assert ngram().propose([5]) == []
    assert ngram().propose([]) == []


# ---- the rejection sampler ------------------------------------------------------------------------

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


# ---- configuration --------------------------------------------------------------------------------

def test_speculative_config_as_vllm_takes_it():
    c = speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (1, 1)
    assert SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3}).method == "draft_model"
    c = speculative_config({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    assert speculative_config(None) is None


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a \"model\""),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        speculative_config(bad)


# ---- the scheduler ----------------------------------------------------------------------------------

def scheduler(num_blocks: int = 64, budget: int = 64, k: int = 4, max_model_len: int = 128) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             num_speculative_tokens=k)
    return Scheduler(config, KVCacheManager(num_blocks, 4, enable_caching=True))


def hash_chain(tokens: list[int], block_size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size]))
    return hashes


def run_prefill(s: Scheduler, request: Request, drafts: list[int]) -> None:
    so = s.schedule()
    assert so.num_scheduled_tokens[request.request_id] == request.num_prompt_tokens
    s.update_from_output(so, ModelRunnerOutput([request.request_id], [[50]], [None], spec_token_ids=[drafts]))


def test_drafts_are_scheduled_budgeted_and_rolled_back():
    s = scheduler()
    r = Request("a", list(range(10, 20)), SamplingParams(max_tokens=50), None)
    s.add_request(r)
    run_prefill(s, r, [60, 61, 62, 63])
    assert r.spec_token_ids == [60, 61, 62, 63] and r.all_token_ids[-1] == 50
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 5}
    assert so.scheduled_spec_decode_tokens == {"a": [60, 61, 62, 63]}
    assert r.num_computed_tokens == 15 and r.spec_token_ids == []
    # The model accepts 60 and 61 and samples 70 instead of 62.
    out = s.update_from_output(so, ModelRunnerOutput(["a"], [[60, 61, 70]], [None], spec_token_ids=[[1, 2]]))
    assert out.outputs[0].new_token_ids == [60, 61, 70]
    assert r.num_tokens == 14 and r.num_computed_tokens == 13  # 62 and 63 rolled back; 70 is next
    assert r.spec_token_ids == [1, 2]
    stats = out.scheduler_stats.spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    # The rejected drafts were never hashed: the hashes are those of the request's own tokens.
    assert r.block_hashes == hash_chain(r.all_token_ids[:len(r.block_hashes) * 4])
    assert len(r.block_hashes) * 4 <= 11  # registered while 62 and 63 were being computed


def test_drafts_are_cut_by_the_budget_and_by_max_tokens():
    s = scheduler(budget=3)
    r = Request("a", [1, 2], SamplingParams(max_tokens=50), None)
    s.add_request(r)
    run_prefill(s, r, [7, 8, 9, 10])
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [7, 8]}

    s = scheduler()
    r = Request("b", [1, 2], SamplingParams(max_tokens=3), None)
    s.add_request(r)
    run_prefill(s, r, [7, 8, 9, 10])
    so = s.schedule()  # 1 token out, 2 to go: one draft and the token after it
    assert so.scheduled_spec_decode_tokens == {"b": [7]}


def test_preemption_drops_drafts():
    s = scheduler(num_blocks=5, k=4)  # 4 usable blocks of 4 tokens
    a = Request("a", list(range(1, 8)), SamplingParams(max_tokens=50), None)
    b = Request("b", list(range(1, 8)), SamplingParams(max_tokens=50), None, arrival_time=a.arrival_time + 1)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[9], [9]], [None, None],
                                               spec_token_ids=[[1, 2, 3, 4], [1, 2, 3, 4]]))
    so = s.schedule()  # a needs a third block for its drafts: b is preempted
    assert so.preempted_req_ids == {"b"} and b.spec_token_ids == [] and b.num_computed_tokens == 0
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3, 4]}


def test_no_drafts_while_the_batch_is_as_wide_as_disable_by_batch_size():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                             num_speculative_tokens=4, speculative_disable_by_batch_size=2)
    s = Scheduler(config, KVCacheManager(64, 4, enable_caching=True))
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50), None)
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=2), None)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[9], [9]], [None, None], spec_token_ids=[[7, 8], [7]]))
    so = s.schedule()  # two running: no drafts, each decodes one token
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[10], [10]], [None, None], spec_token_ids=[[7, 8], []]))
    assert b.is_finished
    so = s.schedule()  # one running: its drafts are scheduled
    assert so.scheduled_spec_decode_tokens == {"a": [7, 8]}
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig("ngram", 4, disable_by_batch_size=0)


def test_a_draft_model_gets_lookahead_slots_that_are_never_hashed():
    """With a draft model the scheduler holds k slots past a sampling request's step for the draft's
    guesses; a prefill chunk that does not sample gets none; the guesses' blocks are never cached."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6, max_model_len=128,
                             num_speculative_tokens=4, num_lookahead_tokens=4)
    kv = KVCacheManager(64, 4, enable_caching=True)
    s = Scheduler(config, kv)
    r = Request("a", list(range(10, 20)), SamplingParams(max_tokens=50), None)
    s.add_request(r)
    so = s.schedule()  # 6 of 10 prompt tokens: no sample, no lookahead
    assert so.num_scheduled_tokens == {"a": 6} and len(kv.get_block_ids("a")) == 2
    s.update_from_output(so, ModelRunnerOutput([], [], []))
    so = s.schedule()  # the last 4: samples, so 4 more slots (positions 10..13)
    assert so.num_scheduled_tokens == {"a": 4} and len(kv.get_block_ids("a")) == 4
    s.update_from_output(so, ModelRunnerOutput(["a"], [[50]], [None], spec_token_ids=[[60, 61]]))
    assert len(kv.num_cached_blocks) == 1 and kv.num_cached_blocks["a"] == 2  # the 8 known tokens' blocks
    so = s.schedule()  # 50 and two drafts: positions 10..12, lookahead to 16
    assert so.num_scheduled_tokens == {"a": 3} and len(kv.get_block_ids("a")) == 5
    assert kv.num_cached_blocks["a"] == 2
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    kv.check_invariants()


def test_the_stats_line_reports_acceptance():
    from kestrel.engine.stat_logger import LoggingStatLogger
    from kestrel.messages import SchedulerStats, SpecDecodingStats
    now = [0.0]
    logger = LoggingStatLogger(interval_s=10.0, clock=lambda: now[0])
    for _ in range(2):
        logger.record(SchedulerStats(num_running_reqs=1, num_generation_tokens=5, spec_decoding=SpecDecodingStats(
            num_drafts=2, num_draft_tokens=8, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0, 0])))
    now[0] = 10.0
    line = logger.log()
    assert "Spec decode: mean acceptance length 2.50, accepted 6/16 draft tokens (37.5%), " \
           "per position: 1.000, 0.500, 0.000, 0.000" in line
    now[0] = 20.0
    logger.record(SchedulerStats(num_running_reqs=1, num_generation_tokens=5))
    assert "Spec decode" not in logger.log()  # counted per line
