"""Unit tests of the scheduler (kestrel.core.scheduler) driven by a fake model: no weights.

The fake worker mirrors what a real model runner does with a SchedulerOutput: it keeps each
request's token ids and block table, "computes" scheduled tokens by writing them into a fake KV
store at (block id, offset), and before every step reads back the request's already-computed
prefix from that store. So a wrong block table, a bad prefix-cache hit or a block handed to two
requests at once shows up as a mismatch. A request whose scheduled tokens reach its last token
samples a token that depends on everything it read.
"""

from __future__ import annotations

import pytest

from kestrel.config import SchedulerConfig
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.scheduler import Scheduler
from kestrel.messages import EngineCoreOutputs, FinishReason, ModelRunnerOutput, SchedulerOutput
from kestrel.sampling_params import SamplingParams

EOS = 2


def hash_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence (never EOS)."""
    return 10 + sum((i + 1) * t for i, t in enumerate(tokens)) % 90


def const_token(value: int):
    return lambda tokens: value


class FakeWorker:
    """`windows`: per KV-cache group, its sliding window (None: full attention). A group's table may
    hold the null block 0 only where its window has passed (no later token reads it), and the tokens a
    group's attention reads (a window's last W, or all) must be in its blocks."""

    def __init__(self, block_size: int, token_fn=hash_token, windows=(None,)) -> None:
        self.bs = block_size
        self.token_fn = token_fn
        self.windows = windows
        self.kv: dict[tuple[int, int], int] = {}
        self.reqs: dict[str, dict] = {}

    def _first_read(self, start: int, window: int | None) -> int:
        return 0 if window is None else max(0, start - window + 1)

    def _check_nulls(self, tables: list[list[int]], start: int) -> None:
        for table, window in zip(tables, self.windows):
            first = self._first_read(start, window) // self.bs
            assert 0 not in table[first:], (table, start, window)
            live = [b for b in table if b != 0]
            assert len(set(live)) == len(live)
        every = [b for table in tables for b in table if b != 0]
        assert len(set(every)) == len(every), "a block in two groups of one request"

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id} sent as new while the worker holds it"
            assert len(nr.block_ids) == len(self.windows)
            self._check_nulls(nr.block_ids, nr.num_computed_tokens)
            self.reqs[nr.req_id] = {"tokens": list(nr.prompt_token_ids) + list(nr.output_token_ids),
                                    "blocks": [list(ids) for ids in nr.block_ids],
                                    "computed": nr.num_computed_tokens}
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                 cached.num_computed_tokens):
            st = self.reqs[rid]
            assert st["computed"] == num_computed, (rid, st["computed"], num_computed)
            for table, added, window in zip(st["blocks"], new_blocks, self.windows):
                assert 0 not in added[self._first_read(num_computed, window) // self.bs - len(table):]
                table.extend(added)
        assert set(so.num_scheduled_tokens) == (
            {nr.req_id for nr in so.scheduled_new_reqs} | set(cached.req_ids))
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, tokens = st["computed"], st["tokens"]
            assert n > 0 and start + n <= len(tokens), (rid, start, n, len(tokens))
            for g, (blocks, window) in enumerate(zip(st["blocks"], self.windows)):
                assert len(blocks) >= -(-(start + n) // self.bs), "block table too short"
                first = self._first_read(start, window)
                seen = [self.kv.get((blocks[p // self.bs], p % self.bs)) for p in range(first, start)]
                assert seen == tokens[first:start], f"{rid}: KV of its computed prefix is wrong in group {g}"
                for p in range(start, start + n):
                    self.kv[(blocks[p // self.bs], p % self.bs)] = tokens[p]
            st["computed"] = start + n
            if st["computed"] == len(tokens):
                token = self.token_fn(tokens)
                tokens.append(token)
                req_ids.append(rid)
                sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=[None] * len(req_ids))


class Harness:
    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                 max_model_len=256, enable_caching=True, enable_chunked_prefill=True,
                 token_fn=hash_token, windows=(None,)) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching, windows)
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=enable_chunked_prefill)
        self.sched = Scheduler(self.config, self.kv)
        self.worker = FakeWorker(block_size, token_fn, windows)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[FinishReason, int | str | None]] = {}
        self.num_cached: dict[str, int] = {}
        self.sched_outputs: list[SchedulerOutput] = []
        self.core_outputs: list[EngineCoreOutputs] = []

    def add(self, rid: str, prompt: list[int], **params) -> Request:
        params.setdefault("max_tokens", 8)
        req = Request(rid, list(prompt), SamplingParams(**params), eos_token_id=EOS)
        self.sched.add_request(req)
        self.tokens[rid] = []
        return req

    def schedule(self) -> SchedulerOutput:
        sched = self.sched
        budget = self.config.max_num_batched_tokens
        decoding = [r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
        so = sched.schedule()
        self.kv.check_invariants()
        assert so.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= self.config.max_num_seqs
        assert len(so.num_scheduled_tokens) <= self.config.max_num_seqs
        if not so.preempted_req_ids and len(decoding) <= budget:
            # Decodes are served before any prefill takes the budget.
            assert all(rid in so.num_scheduled_tokens for rid in decoding), (decoding, so)
            assert list(so.num_scheduled_tokens)[:len(decoding)] == decoding
        for rid in so.num_scheduled_tokens:
            req = sched.requests[rid]
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens <= req.num_tokens
            # The KV manager holds room for every token computed after this step.
            assert len(self.kv.get_block_ids(rid)[0]) * self.kv.block_size >= req.num_computed_tokens
        self.sched_outputs.append(so)
        return so

    def update(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> EngineCoreOutputs:
        # The fake worker samples exactly for requests whose computed tokens reached the end.
        expected = [rid for rid in so.num_scheduled_tokens
                    if rid in self.sched.requests
                    and self.sched.requests[rid].num_computed_tokens == self.sched.requests[rid].num_tokens]
        assert [rid for rid in ro.req_ids if rid in self.sched.requests] == expected
        return self.record(self.sched.update_from_output(so, ro))

    def record(self, out: EngineCoreOutputs) -> EngineCoreOutputs:
        """Keep a step's outputs: tokens in order, nothing after a request's end, whose blocks are free."""
        self.kv.check_invariants()
        for o in out.outputs:
            assert o.request_id not in self.finish, f"output after {o.request_id} finished"
            self.tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                self.finish[o.request_id] = (o.finish_reason, o.stop_reason)
                self.num_cached[o.request_id] = o.num_cached_tokens
                assert o.request_id not in self.sched.requests
                assert self.kv.get_block_ids(o.request_id)[0] == []
        self.core_outputs.append(out)
        return out

    def step(self) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        so = self.schedule()
        out = self.update(so, self.worker.execute(so))
        return so, out

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        self.check_idle()
        return steps

    def check_idle(self) -> None:
        self.kv.check_invariants()
        assert not self.sched.has_unfinished_requests()
        assert self.sched.requests == {}
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks - 1
        assert not self.kv.req_to_blocks
        # One more (empty) step tells the worker to drop every finished request.
        so = self.sched.schedule()
        assert so.is_empty and not so.scheduled_new_reqs
        self.worker.execute(so)
        assert self.worker.reqs == {}, "the worker was never told that these requests ended"

    def stats_sum(self, field: str) -> int:
        return sum(getattr(o.scheduler_stats, field) for o in self.core_outputs)


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def reference_outputs(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    out = {}
    for rid, p in prompts.items():
        toks = list(p)
        for _ in range(max_tokens):
            toks.append(hash_token(toks))
        out[rid] = toks[len(p):]
    return out


# ---- budget, chunking, ordering ----------------------------------------------------------------


def test_token_budget_and_chunked_prefill():
    h = Harness(max_num_batched_tokens=16, num_blocks=64)
    prompts = {"long": prompt(50, 100), "short": prompt(10, 300), "mid": prompt(30, 500)}
    for rid, p in prompts.items():
        h.add(rid, p, max_tokens=5)
    h.run()
    assert all(so.total_num_scheduled_tokens <= 16 for so in h.sched_outputs)
    assert any(so.total_num_scheduled_tokens == 16 for so in h.sched_outputs)
    # The 50-token prompt was split into chunks over several steps before its first token.
    chunks = []
    for so, out in zip(h.sched_outputs, h.core_outputs):
        if "long" in so.num_scheduled_tokens:
            chunks.append(so.num_scheduled_tokens["long"])
        if any(o.request_id == "long" for o in out.outputs):
            break
    assert sum(chunks) == 50 and len(chunks) >= 4 and max(chunks) <= 16
    assert h.tokens == reference_outputs(prompts, 5)
    assert all(f == (FinishReason.LENGTH, None) for f in h.finish.values())
    assert h.stats_sum("num_prompt_tokens") == 90
    assert h.stats_sum("num_generation_tokens") == 15


def test_decode_is_served_before_new_prefill():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", prompt(4), max_tokens=10)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 4}
    h.add("b", prompt(20, 400), max_tokens=3)
    so, _ = h.step()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    so, _ = h.step()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    h.add("c", prompt(20, 700), max_tokens=3)
    so, _ = h.step()  # b finishes its prefill (6 left); c gets the last token of budget
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 6), ("c", 1)]
    so, _ = h.step()  # a and b decode first, c's prefill takes what is left
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    h.run()


def test_max_num_seqs():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=64)
    prompts = {f"r{i}": prompt(6, 100 * i) for i in range(5)}
    for rid, p in prompts.items():
        h.add(rid, p, max_tokens=4)
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert len(h.sched.waiting) == 3
    h.run()
    assert max(len(so.num_scheduled_tokens) for so in h.sched_outputs) == 2
    assert h.tokens == reference_outputs(prompts, 4)


def test_chunked_prefill_disabled_admits_whole_prompts_only():
    h = Harness(max_num_batched_tokens=16, enable_chunked_prefill=False)
    h.add("a", prompt(10), max_tokens=3)
    h.add("b", prompt(10, 300), max_tokens=3)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 10}  # b does not fit in the 6 left, and is not split
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}
    h.run()
    for so in h.sched_outputs:
        for nr in so.scheduled_new_reqs:
            assert so.num_scheduled_tokens[nr.req_id] == len(nr.prompt_token_ids)


# ---- stopping ----------------------------------------------------------------------------------


def test_finish_on_max_tokens():
    h = Harness()
    h.add("a", prompt(7), max_tokens=5)
    h.add("b", prompt(7, 300), max_tokens=1)
    h.run()
    assert h.finish == {"a": (FinishReason.LENGTH, None), "b": (FinishReason.LENGTH, None)}
    assert len(h.tokens["a"]) == 5 and len(h.tokens["b"]) == 1


def test_finish_on_eos_and_ignore_eos():
    h = Harness(token_fn=const_token(EOS))
    h.add("stop", prompt(5), max_tokens=10)
    h.add("ignore", prompt(5, 300), max_tokens=6, ignore_eos=True)
    h.run()
    assert h.finish["stop"] == (FinishReason.STOP, None)
    assert h.tokens["stop"] == [EOS]
    assert h.finish["ignore"] == (FinishReason.LENGTH, None)
    assert h.tokens["ignore"] == [EOS] * 6


def test_eos_mid_generation():
    seq = iter([11, 12, EOS, 13, 14])
    h = Harness(token_fn=lambda tokens: next(seq))
    h.add("a", prompt(5), max_tokens=10)
    h.run()
    assert h.tokens["a"] == [11, 12, EOS]
    assert h.finish["a"] == (FinishReason.STOP, None)


def test_finish_on_stop_token_ids():
    h = Harness(token_fn=lambda tokens: 40 + len(tokens))  # prompt 5 → 45, 46, 47, ...
    h.add("a", prompt(5), max_tokens=10, stop_token_ids=[47, 49])
    h.add("b", prompt(5, 300), max_tokens=10, stop_token_ids=[99])
    h.run()
    assert h.tokens["a"] == [45, 46, 47]
    assert h.finish["a"] == (FinishReason.STOP, 47)
    assert h.finish["b"] == (FinishReason.LENGTH, None)


def test_min_tokens_delays_eos_and_stop_tokens():
    h = Harness(token_fn=const_token(EOS))
    h.add("a", prompt(5), max_tokens=10, min_tokens=4)
    h.run()
    assert h.tokens["a"] == [EOS] * 4
    assert h.finish["a"] == (FinishReason.STOP, None)

    h = Harness(token_fn=const_token(33))
    h.add("b", prompt(5), max_tokens=10, min_tokens=3, stop_token_ids=[33])
    h.run()
    assert h.tokens["b"] == [33] * 3
    assert h.finish["b"] == (FinishReason.STOP, 33)


def test_max_model_len_caps_length():
    h = Harness(max_model_len=16)
    h.add("a", prompt(10), max_tokens=100)
    h.add("b", prompt(10, 300), max_tokens=None)  # resolved to max_model_len - prompt
    h.run()
    assert len(h.tokens["a"]) == 6 and len(h.tokens["b"]) == 6
    assert h.finish["a"] == h.finish["b"] == (FinishReason.LENGTH, None)


def test_duplicate_request_id_rejected():
    h = Harness()
    h.add("a", prompt(5))
    with pytest.raises(ValueError):
        h.add("a", prompt(5))


# ---- preemption --------------------------------------------------------------------------------


# KV-cache groups: one full-attention group (Llama); one sliding-window group (Mistral); a full group
# and two sliding ones (Gemma 3's mix), windows of 6 tokens over blocks of 4.
GROUPS = {"full": (None,), "sliding": (6,), "mixed": (None, 6, 6)}


@pytest.mark.parametrize("enable_caching", [True, False])
@pytest.mark.parametrize("groups", ["full", "mixed"])
def test_preemption_recomputes_and_every_request_finishes(enable_caching, groups):
    # 5 usable blocks of 4 tokens; each request needs 3 blocks (5 + 8 tokens): 9 in all (mixed: a full
    # and a sliding group, 8 usable blocks, a request holding up to 4 + 3).
    h = Harness(num_blocks=6 if groups == "full" else 9, block_size=4, max_num_batched_tokens=32,
                enable_caching=enable_caching, windows=(None,) if groups == "full" else (None, 6))
    prompts = {f"r{i}": prompt(5, 100 * (i + 1)) for i in range(3)}
    for rid, p in prompts.items():
        h.add(rid, p, max_tokens=8)
    saw_preemption = False
    steps = 0
    while h.sched.has_unfinished_requests():
        so = h.schedule()
        if so.preempted_req_ids:
            saw_preemption = True
            n = len(so.preempted_req_ids)
            head = [r.request_id for r in list(h.sched.waiting)[:n]]
            assert set(head) == so.preempted_req_ids  # back at the head of the queue
            for rid in so.preempted_req_ids:
                req = h.sched.requests[rid]
                assert req.status == RequestStatus.PREEMPTED
                assert req.num_computed_tokens == 0
                assert req.num_preemptions >= 1
                assert h.kv.get_block_ids(rid)[0] == []
                assert rid not in so.num_scheduled_tokens
                assert req not in h.sched.running
            assert not so.scheduled_new_reqs  # no admission in a step that preempted
        h.update(so, h.worker.execute(so))
        steps += 1
        assert steps < 500
    h.check_idle()
    assert saw_preemption
    assert h.sched.num_preemptions_total > 0
    assert h.stats_sum("num_preemptions") == h.sched.num_preemptions_total
    # Recompute gives the same output as an unpreempted run.
    assert h.tokens == reference_outputs(prompts, 8)
    assert all(f == (FinishReason.LENGTH, None) for f in h.finish.values())


def test_preempted_request_resumes_with_outputs():
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=32, enable_caching=False)
    prompts = {"a": prompt(5), "b": prompt(5, 300)}
    for rid, p in prompts.items():
        h.add(rid, p, max_tokens=10)
    resumed = []
    while h.sched.has_unfinished_requests():
        so = h.schedule()
        for nr in so.scheduled_new_reqs:
            if nr.output_token_ids:
                resumed.append(nr)
                # Resume: recompute prompt + outputs so far, from scratch (no caching here).
                assert nr.num_computed_tokens == 0
                assert so.num_scheduled_tokens[nr.req_id] == len(nr.prompt_token_ids) + len(
                    nr.output_token_ids)
                assert nr.output_token_ids == h.tokens[nr.req_id]
        h.update(so, h.worker.execute(so))
    h.check_idle()
    assert resumed, "expected a preempted request to be resumed"
    assert h.tokens == reference_outputs(prompts, 10)


# ---- abort -------------------------------------------------------------------------------------


def test_abort_frees_blocks():
    h = Harness(max_num_batched_tokens=8, max_num_seqs=2)
    h.add("run", prompt(12), max_tokens=20)
    h.add("other", prompt(6, 300), max_tokens=20)
    h.add("wait", prompt(6, 500), max_tokens=20)
    h.step()
    h.step()
    assert h.kv.get_block_ids("run")[0]
    assert h.sched.waiting[0].request_id == "wait"
    free_before = h.kv.pool.num_free_blocks
    n_blocks = len(h.kv.get_block_ids("run")[0])
    h.sched.finish_requests(["run", "wait", "no-such-id"], RequestStatus.FINISHED_ABORTED)
    h.kv.check_invariants()
    assert h.kv.get_block_ids("run")[0] == []
    assert h.kv.pool.num_free_blocks == free_before + n_blocks
    assert "run" not in h.sched.requests and "wait" not in h.sched.requests
    assert list(h.sched.waiting) == [] and [r.request_id for r in h.sched.running] == ["other"]
    h.sched.finish_requests(["run"], RequestStatus.FINISHED_ABORTED)  # twice: ignored
    so, _ = h.step()
    assert {"run", "wait"} <= so.finished_req_ids  # the worker is told to drop them
    assert "run" not in so.num_scheduled_tokens
    h.run()
    assert "run" not in h.finish and h.finish["other"] == (FinishReason.LENGTH, None)


def test_abort_while_step_runs_drops_its_output():
    h = Harness()
    h.add("a", prompt(5), max_tokens=5)
    h.add("b", prompt(5, 300), max_tokens=5)
    so = h.schedule()
    ro = h.worker.execute(so)
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = h.sched.update_from_output(so, ro)
    h.kv.check_invariants()
    assert [o.request_id for o in out.outputs] == ["b"]
    assert h.kv.get_block_ids("a")[0] == []
    so = h.schedule()
    assert "a" in so.finished_req_ids
    h.update(so, h.worker.execute(so))
    h.run()


# ---- prefix caching through the scheduler ------------------------------------------------------


def test_prefix_cache_hits_for_repeated_prompt():
    h = Harness(block_size=4, num_blocks=32)
    p = prompt(40)
    h.add("first", p, max_tokens=3)
    h.run()
    assert h.kv.take_prefix_cache_stats() == (0, 0)  # already taken into the step stats
    assert h.stats_sum("prefix_cache_queries") == 40
    assert h.stats_sum("prefix_cache_hits") == 0
    n = len(h.core_outputs)

    h.add("again", p, max_tokens=3)
    so, _ = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 36  # 9 full blocks; last token recomputed
    assert so.num_scheduled_tokens == {"again": 4}
    h.run()
    tail = h.core_outputs[n:]
    assert sum(o.scheduler_stats.prefix_cache_queries for o in tail) == 40
    assert sum(o.scheduler_stats.prefix_cache_hits for o in tail) == 36
    assert sum(o.scheduler_stats.num_prompt_tokens for o in tail) == 4
    assert h.num_cached["again"] == 36 and h.num_cached["first"] == 0
    assert h.tokens["again"] == h.tokens["first"]


@pytest.mark.parametrize("groups", list(GROUPS))
def test_prefix_cache_shared_by_concurrent_requests(groups):
    h = Harness(block_size=4, num_blocks=64, max_num_batched_tokens=16, windows=GROUPS[groups])
    shared = prompt(24)
    prompts = {f"r{i}": shared + prompt(3, 1000 * (i + 1)) for i in range(4)}
    for rid, pr in prompts.items():
        h.add(rid, pr, max_tokens=6)
    h.run()
    assert h.tokens == reference_outputs(prompts, 6)
    assert h.stats_sum("prefix_cache_hits") > 0
    assert h.stats_sum("prefix_cache_queries") == sum(len(pr) for pr in prompts.values())


def test_no_prefix_hits_when_caching_disabled():
    h = Harness(block_size=4, num_blocks=32, enable_caching=False)
    h.add("first", prompt(40), max_tokens=2)
    h.run()
    h.add("again", prompt(40), max_tokens=2)
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"again": 40}
    h.run()
    assert h.stats_sum("prefix_cache_hits") == 0
    assert h.num_cached["again"] == 0


@pytest.mark.parametrize("groups", list(GROUPS))
def test_random_workload_invariants(groups):
    import random

    rng = random.Random(1234)
    h = Harness(num_blocks=24 if groups == "full" else 30, block_size=4, max_num_batched_tokens=20, max_num_seqs=5,
                windows=GROUPS[groups])
    prompts = {}
    base = [rng.randrange(10, 100) for _ in range(16)]
    for i in range(14):
        n = rng.randint(1, 30)
        pr = (base[:rng.choice([0, 4, 8, 16])] + [rng.randrange(10, 100) for _ in range(n)])
        prompts[f"q{i}"] = pr
        h.add(f"q{i}", pr, max_tokens=rng.randint(1, 12))
    aborted = set()
    steps = 0
    while h.sched.has_unfinished_requests():
        h.step()
        steps += 1
        if steps % 7 == 0 and h.sched.running:
            victim = rng.choice(h.sched.running).request_id
            h.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            h.kv.check_invariants()
            aborted.add(victim)
        assert steps < 2000
    h.check_idle()
    for rid, pr in prompts.items():
        if rid in aborted:
            continue
        req_max = len(h.tokens[rid])
        assert h.finish[rid] == (FinishReason.LENGTH, None)
        assert h.tokens[rid] == reference_outputs({rid: pr}, req_max)[rid]


def test_no_admission_in_a_step_that_preempted():
    """Two requests with the same prompt decode in lockstep; the second holds unhashed duplicates
    of the first's blocks, so once preempted it could be re-admitted at once from prefix hits on
    the first's blocks. The rule is that a step that preempted admits nobody."""
    h = Harness(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    p = prompt(8)
    h.add("r", p, max_tokens=10)
    h.add("v", p, max_tokens=10)
    preempt_steps = []
    while h.sched.has_unfinished_requests():
        so = h.schedule()
        if so.preempted_req_ids:
            preempt_steps.append(len(h.sched_outputs) - 1)
            assert so.preempted_req_ids == {"v"}
            assert so.scheduled_new_reqs == []
            assert set(so.num_scheduled_tokens) == {"r"}
        h.update(so, h.worker.execute(so))
        assert len(h.sched_outputs) < 200
    h.check_idle()
    assert preempt_steps
    # Re-admitted next step, straight from prefix hits on r's blocks.
    resumed = h.sched_outputs[preempt_steps[0] + 1].scheduled_new_reqs
    assert [nr.req_id for nr in resumed] == ["v"]
    assert resumed[0].num_computed_tokens > 0
    assert h.tokens["r"] == h.tokens["v"] == reference_outputs({"r": p}, 10)["r"]


def test_a_request_in_flight_is_not_scheduled_again_until_its_step_returns():
    """The pipeline's batch queue schedules step N+1 before step N's results are back: a request in
    step N (a decode, or a prefill with chunks left) waits for them; other requests go ahead."""
    h = Harness(max_num_batched_tokens=8)
    h.add("long", list(range(1, 21)))     # 20 tokens: chunks of 8
    first = h.schedule()
    assert first.num_scheduled_tokens == {"long": 8}
    h.add("short", [5, 6, 7])
    second = h.schedule()                 # "long" is in flight: only the newcomer is scheduled
    assert second.num_scheduled_tokens == {"short": 3}
    h.update(first, h.worker.execute(first))
    h.update(second, h.worker.execute(second))
    third = h.schedule()                  # both back: the decode first, then long's next chunk
    assert third.num_scheduled_tokens == {"short": 1, "long": 7}
    # A decode's input token reaches ranks that did not sample it through new_token_ids.
    cached = third.scheduled_cached_reqs
    assert cached.new_token_ids[cached.req_ids.index("short")] == h.tokens["short"][-1:]
    assert cached.new_token_ids[cached.req_ids.index("long")] == []
    h.update(third, h.worker.execute(third))
    h.run()
