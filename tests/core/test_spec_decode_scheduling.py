"""Speculative decoding (issue 19) in the scheduler: the budgeting and roll-back of draft tokens, and a
draft model's lookahead slots. (The n-gram proposer: tests/worker/test_ngram_proposer.py; the rejection
sampler: tests/sample/test_rejection_sampler.py; the configuration: tests/engine/test_speculative_config.py.)"""

from __future__ import annotations

import pytest

from kestrel.config import SchedulerConfig, SpeculativeConfig
from kestrel.core.block_pool import hash_block_tokens
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.scheduler import Scheduler
from kestrel.messages import ModelRunnerOutput
from kestrel.sampling_params import SamplingParams


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
    assert so.num_scheduled_tokens == {"a": 6} and len(kv.get_block_ids("a")[0]) == 2
    s.update_from_output(so, ModelRunnerOutput([], [], []))
    so = s.schedule()  # the last 4: samples, so 4 more slots (positions 10..13)
    assert so.num_scheduled_tokens == {"a": 4} and len(kv.get_block_ids("a")[0]) == 4
    s.update_from_output(so, ModelRunnerOutput(["a"], [[50]], [None], spec_token_ids=[[60, 61]]))
    assert len(kv.num_cached_blocks) == 1 and kv.num_cached_blocks["a"] == 2  # the 8 known tokens' blocks
    so = s.schedule()  # 50 and two drafts: positions 10..12, lookahead to 16
    assert so.num_scheduled_tokens == {"a": 3} and len(kv.get_block_ids("a")[0]) == 5
    assert kv.num_cached_blocks["a"] == 2
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    kv.check_invariants()
