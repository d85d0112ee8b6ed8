"""Async scheduling in the scheduler (issue 19): step N+1 is planned before step N's results are in.

Driven as the engine core drives it (a batch queue two deep): schedule and submit N+1 while N is in
flight, then apply N's results. The fake worker of test_scheduler runs each step when it is
submitted, in order, as the real worker does; it keeps every request's tokens and checks the KV of
its computed prefix at every step, so a placeholder scheduled at the wrong position, a block freed
too early or a dropped result shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest

from kestrel.config import ParallelConfig, SpeculativeConfig
from kestrel.core.request import RequestStatus
from kestrel.core.scheduler import Scheduler
from kestrel.engine.arg_utils import check_async_scheduling
from kestrel.messages import FinishReason, SchedulerOutput
from tests.core.test_scheduler import EOS, Harness, prompt, reference_outputs


class AsyncHarness(Harness):
    """test_scheduler's harness with async scheduling on, stepped as a batch queue two deep."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.config = dataclasses.replace(self.config, async_scheduling=True)
        self.sched = Scheduler(self.config, self.kv)
        self.in_flight: deque = deque()
        self.sampled_by_worker: dict[str, int] = {}
        self.outputs: list[SchedulerOutput] = []
        self.placeholder_steps = 0  # steps that scheduled a request whose last step was still in flight
        self.preempted_in_flight: list[str] = []  # requests preempted while a step of theirs ran

    def submit(self) -> SchedulerOutput:
        """Schedule a step and run it on the fake worker (it has every earlier step's tokens)."""
        pending = {rid for so, _ in self.in_flight for rid in so.num_scheduled_tokens}
        so = self.sched.schedule()
        self.kv.check_invariants()
        assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        if pending & set(so.num_scheduled_tokens):
            self.placeholder_steps += 1
        for rid in so.preempted_req_ids:
            request = self.sched.requests[rid]
            assert request.status == RequestStatus.PREEMPTED and request.num_output_placeholders == 0
            if rid in pending:
                self.preempted_in_flight.append(rid)
        for rid in so.num_scheduled_tokens:
            request = self.sched.requests[rid]
            assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
            assert request.num_output_tokens + request.num_output_placeholders <= request.max_tokens
        ro = self.worker.execute(so)
        for rid in ro.req_ids:
            self.sampled_by_worker[rid] = self.sampled_by_worker.get(rid, 0) + 1
        self.in_flight.append((so, ro))
        self.outputs.append(so)
        return so

    def apply_oldest(self) -> None:
        so, ro = self.in_flight.popleft()
        self.record(self.sched.update_from_output(so, ro))

    def step(self) -> None:
        """What EngineCore.step_with_batch_queue does with a queue of two."""
        if len(self.in_flight) < 2 and self.sched.has_unfinished_requests():
            so = self.submit()
            if so.total_num_scheduled_tokens and len(self.in_flight) < 2:
                return
        if self.in_flight:
            self.apply_oldest()

    def run(self, max_steps: int = 2000, each_step=None) -> None:
        steps = 0
        while self.sched.has_unfinished_requests() or self.in_flight:
            self.step()
            if each_step is not None:
                each_step(steps)
            steps += 1
            assert steps < max_steps, "no progress"
        self.kv.check_invariants()
        assert self.sched.requests == {} and not self.kv.req_to_blocks
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks - 1
        so = self.sched.schedule()  # tells the worker to drop what ended
        assert so.is_empty
        self.worker.execute(so)
        assert self.worker.reqs == {}


def test_the_next_step_is_planned_before_the_last_one_returns():
    h = AsyncHarness()
    h.add("a", prompt(6))
    first = h.submit()
    assert first.num_scheduled_tokens == {"a": 6}
    request = h.sched.requests["a"]
    assert request.num_output_placeholders == 1
    second = h.submit()  # a's first token is still being sampled: scheduled with a placeholder
    assert second.num_scheduled_tokens == {"a": 1}
    cached = second.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.new_token_ids == [[]] and cached.num_computed_tokens == [6]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 7
    h.apply_oldest()
    assert request.num_output_placeholders == 1 and h.tokens["a"] == reference_outputs({"a": prompt(6)}, 1)["a"]
    h.run()
    assert h.tokens["a"] == reference_outputs({"a": prompt(6)}, 8)["a"]


@pytest.mark.parametrize("budget", [64, 7])
def test_outputs_are_those_of_synchronous_scheduling(budget):
    """Mixed prompt lengths, chunked prefill under a small budget, prefix sharing: every token as the
    model gives it, and no step past max_tokens (lengths stop exactly, nothing computed for nothing)."""
    h = AsyncHarness(max_num_batched_tokens=budget)
    rng = random.Random(0)
    shared = prompt(12, 500)
    prompts = {f"r{i}": (shared if i % 2 else []) + [rng.randrange(10, 100) for _ in range(rng.randint(1, 20))]
               for i in range(8)}
    max_tokens = {rid: rng.randint(1, 10) for rid in prompts}
    for rid, tokens in prompts.items():
        h.add(rid, tokens, max_tokens=max_tokens[rid])
    h.run()
    for rid, tokens in prompts.items():
        assert h.tokens[rid] == reference_outputs({rid: tokens}, max_tokens[rid])[rid]
        assert h.finish[rid] == (FinishReason.LENGTH, None)
        assert h.sampled_by_worker[rid] == max_tokens[rid]
    assert h.placeholder_steps > 0


def test_a_request_that_stops_has_one_token_computed_for_nothing():
    seq = iter([11, 12, EOS, 13, 14, 15])
    h = AsyncHarness(token_fn=lambda tokens: next(seq))
    h.add("a", prompt(5), max_tokens=10)
    h.run()
    assert h.tokens["a"] == [11, 12, EOS]
    assert h.finish["a"] == (FinishReason.STOP, None)
    assert h.sampled_by_worker["a"] == 4  # the step after EOS was planned before EOS was known


def test_stop_token_ids_and_min_tokens():
    h = AsyncHarness(token_fn=lambda tokens: 40 + len(tokens))  # prompt 5 -> 45, 46, 47, ...
    h.add("a", prompt(5), max_tokens=10, stop_token_ids=[47, 49])
    h.add("b", prompt(5, 300), max_tokens=10, stop_token_ids=[46, 48], min_tokens=3)
    h.run()
    assert h.tokens["a"] == [45, 46, 47] and h.finish["a"] == (FinishReason.STOP, 47)
    assert h.tokens["b"] == [45, 46, 47, 48] and h.finish["b"] == (FinishReason.STOP, 48)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_preempted_while_its_step_runs_drops_that_step_and_recomputes(enable_caching):
    # 5 usable blocks of 4 tokens; each request needs 4 blocks (5 + 10 tokens).
    h = AsyncHarness(num_blocks=6, block_size=4, max_num_batched_tokens=32, enable_caching=enable_caching)
    prompts = {f"r{i}": prompt(5, 100 * (i + 1)) for i in range(3)}
    for rid, tokens in prompts.items():
        h.add(rid, tokens, max_tokens=10)
    h.run()
    assert h.sched.num_preemptions_total > 0 and h.preempted_in_flight
    assert h.tokens == reference_outputs(prompts, 10)
    assert all(f == (FinishReason.LENGTH, None) for f in h.finish.values())


def test_abort_with_two_steps_in_flight():
    h = AsyncHarness()
    h.add("a", prompt(5), max_tokens=6)
    h.add("b", prompt(5, 300), max_tokens=6)
    h.submit()
    h.submit()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert h.kv.get_block_ids("a")[0] == []
    h.apply_oldest()
    h.apply_oldest()
    assert h.tokens["a"] == [] and "a" not in h.finish
    assert "a" in h.submit().finished_req_ids
    h.run()
    assert h.tokens["b"] == reference_outputs({"b": prompt(5, 300)}, 6)["b"]


def test_max_model_len_counts_placeholders():
    h = AsyncHarness(max_model_len=12)
    h.add("a", prompt(8), max_tokens=100)
    h.run()
    assert len(h.tokens["a"]) == 4 and h.finish["a"] == (FinishReason.LENGTH, None)
    assert h.sampled_by_worker["a"] == 4


def test_random_workload_with_aborts():
    rng = random.Random(1234)
    h = AsyncHarness(num_blocks=24, block_size=4, max_num_batched_tokens=20, max_num_seqs=5)
    base = [rng.randrange(10, 100) for _ in range(16)]
    prompts, max_tokens = {}, {}
    for i in range(14):
        tokens = base[:rng.choice([0, 4, 8, 16])] + [rng.randrange(10, 100) for _ in range(rng.randint(1, 30))]
        prompts[f"q{i}"], max_tokens[f"q{i}"] = tokens, rng.randint(1, 12)
        h.add(f"q{i}", tokens, max_tokens=max_tokens[f"q{i}"])
    aborted = set()

    def abort_some(step):
        if step % 7 == 3 and h.sched.running:
            victim = rng.choice(h.sched.running).request_id
            h.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)

    h.run(each_step=abort_some)
    assert aborted
    for rid, tokens in prompts.items():
        expected = reference_outputs({rid: tokens}, max_tokens[rid])[rid]
        if rid in aborted:
            assert expected[:len(h.tokens[rid])] == h.tokens[rid]
        else:
            assert h.tokens[rid] == expected and h.finish[rid] == (FinishReason.LENGTH, None)


def test_what_async_scheduling_cannot_run_with_is_refused_at_start():
    check_async_scheduling(True, ParallelConfig(), None)
    check_async_scheduling(False, ParallelConfig(2, 1), SpeculativeConfig("ngram", 4))
    with pytest.raises(ValueError, match="speculative decoding"):
        check_async_scheduling(True, ParallelConfig(), SpeculativeConfig("ngram", 4))
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        check_async_scheduling(True, ParallelConfig(2, 1), None)
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        check_async_scheduling(True, ParallelConfig(1, 2), None)
    check_async_scheduling(True, ParallelConfig(1, 1, 2), None)  # data parallel: one worker per core
