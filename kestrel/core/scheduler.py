"""Continuous batching under a token budget.

One rule: every request moves `num_computed_tokens` toward `num_tokens`, within the step's token
budget. A new prompt, a prefill chunk, a decode step, a prefix-cache hit and a resumption after
preemption are all that rule with different numbers.

Order inside a step: running requests that decode (one token each) first, then running requests
with prefill left (chunked), then waiting requests in arrival order while budget, sequence slots and
blocks last. When blocks run out for a running request, the last request in that order is preempted
(recompute: its blocks are freed, its progress reset, and it goes back to the head of the waiting
queue); no waiting request is admitted in a step that preempted.

Speculative decoding is the same rule with draft tokens counted in: a decoding request with drafts
(proposed by the worker after its last step) is scheduled for 1 + len(drafts) tokens, budgeted and
given KV slots like any others, except in a step that starts with `speculative_disable_by_batch_size`
requests or more running, which schedules no drafts. With a draft model, a request that samples also holds
`num_lookahead_tokens` slots past its step's tokens, where the draft model writes the KV of its
guesses for the next step before they are known. When the results come back, `num_computed_tokens` moves back over the
rejected drafts, so their slots are written again by the next step; drafts never enter
`all_token_ids` unless accepted, so no block is hashed with a token the model did not accept.

With pipeline stages the engine core keeps several steps in flight: a request in a step whose
results have not come back (`in_flight`) is not scheduled again until they have, since its next
step needs them.

Async scheduling (one worker) is the other way round: step N+1 is planned while step N runs, and a
request whose next token step N is sampling is scheduled again with a placeholder for that token
(`num_output_placeholders`): it counts as known for the token budget and the KV slots, the worker
(which runs steps in order and keeps each request's tokens) fills it in. Its value reaches the
scheduler when step N's results are applied, after step N+1 was planned and before N+2 is. So: a
request is not scheduled past max_tokens or max_model_len counting its placeholders; one that stops
(EOS, a stop token) has one step's token computed for nothing, which is dropped; a request preempted
while a step of its was running drops that step's results (it recomputes them after resuming, and it
cannot be resumed before they are in, since a step that preempts admits nobody).

With request traces on (`trace_requests`), each request collects timed events: queued, scheduled
(with its prefix-cache hits) or resumed, preempted, one `step` per step it was in (its tokens, the
batch's size, and the step's time split into schedule / prepare inputs / forward / sample), finished;
they travel in the request's next output.

Prompt logprobs computed by the worker travel in the request's output of the same step, even for a
partial prefill chunk (an output with no new tokens); positions already sent before a preemption
are not sent again.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kestrel.config import SchedulerConfig
from kestrel.core.kv_cache_manager import KVCacheManager
from kestrel.core.request import Request, RequestStatus
from kestrel.core.structured_output import StructuredOutputManager
from kestrel.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EventType,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
    StepStats,
)


@dataclass(frozen=True)
class StepTrace:
    """When a step started (monotonic clock) and how long scheduling it took: the engine core's part of
    the step's time, for its `StepStats` and for request traces."""
    start: float
    schedule_s: float


def step_stats(so: SchedulerOutput, ro: ModelRunnerOutput, step: StepTrace | None) -> StepStats:
    """The step's batch and time split (times are zero where the step was not timed)."""
    stats = StepStats(num_reqs=len(so.num_scheduled_tokens), num_tokens=so.total_num_scheduled_tokens)
    if step is not None:
        stats.schedule_s = step.schedule_s
        stats.total_s = time.monotonic() - step.start
    timings = ro.timings
    if timings is not None:
        stats.prepare_s, stats.forward_s, stats.sample_s = timings.prepare_s, timings.forward_s, timings.sample_s
    return stats


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.structured_output = structured_output
        # Requests that ended outside a step (a grammar that did not compile): reported with the next
        # step's outputs.
        self._ended_outside_step: list[EngineCoreOutput] = []
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the worker still holds state for but must drop at the next step.
        self.finished_req_ids: set[str] = set()
        # Requests in a step whose results have not come back yet (only under pipeline parallelism
        # does the engine core schedule before they have).
        self.in_flight: set[str] = set()
        self.num_preemptions_total = 0
        self._step_preemptions = 0
        self._step_prompt_tokens = 0
        self._spec_stats = (SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
                            if config.num_speculative_tokens else None)

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.max_tokens is None:
            request.max_tokens = self.config.max_model_len - request.num_prompt_tokens
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("this engine core has no structured-output support")
            self.structured_output.submit(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop (abort). Unknown or finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._ended_outside_step)

    def has_constrained_running(self) -> bool:
        """Whether a running request is constrained: its next step's bitmask needs this step's token,
        so async scheduling must apply a step's results before planning the next."""
        return any(r.grammar is not None for r in self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}

        threshold = self.config.speculative_disable_by_batch_size
        speculate = threshold is None or len(self.running) < threshold
        # Decodes first, then prefill chunks; preemption victims come from the end of this order.
        ready = [r for r in self.running if self._can_schedule(r)]
        order = ([r for r in ready if self._num_left(r) == 1] + [r for r in ready if self._num_left(r) > 1])
        i = 0
        while i < len(order) and budget > 0:
            request = order[i]
            drafts = self._drafts_to_schedule(request) if speculate else []
            num_new = min(self._num_left(request) + len(drafts), budget)
            lookahead = self._lookahead(request, num_new)
            new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = order.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                break
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([[b.block_id for b in group] for group in new_blocks])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.new_token_ids.append(
                request.all_token_ids[max(request.num_computed_tokens, request.num_prompt_tokens):
                                      request.num_computed_tokens + num_new])
            num_scheduled[request.request_id] = num_new
            num_drafts = num_new - self._num_left(request)
            if num_drafts > 0:
                spec_tokens[request.request_id] = drafts[:num_drafts]
            request.spec_token_ids = []
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, new_reqs)

        grammar_rows: list[tuple[Request, list[int]]] = []
        for request_id, n in num_scheduled.items():
            request = self.requests[request_id]
            if request.grammar is not None and n >= self._num_left(request):  # it samples this step
                grammar_rows.append((request, spec_tokens.get(request_id, [])))
            self._step_prompt_tokens += max(0, min(request.num_computed_tokens + n, request.num_prompt_tokens)
                                            - request.num_computed_tokens)
            if self.config.async_scheduling and n == self._num_left(request):
                request.num_output_placeholders += 1  # this step samples its next token
            request.num_computed_tokens += n
        if not self.config.async_scheduling:
            self.in_flight.update(num_scheduled)
        grammar_bitmask, structured_output_rows = (self.structured_output.bitmask(grammar_rows)
                                                   if grammar_rows else (b"", {}))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_tokens,
            grammar_bitmask=grammar_bitmask,
            structured_output_rows=structured_output_rows,
        )
        self.finished_req_ids = set()
        return output

    def _num_left(self, request: Request) -> int:
        """Tokens to compute before the request samples again (its placeholders count as known)."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _lookahead(self, request: Request, num_new: int) -> int:
        """KV slots past this step's tokens for a draft model's next guesses: only for a request that
        samples in this step (its drafts are proposed right after it)."""
        return self.config.num_lookahead_tokens if num_new >= self._num_left(request) else 0

    def _can_schedule(self, request: Request) -> bool:
        """Whether a running request may be in this step: not while a step of its is in flight under
        pipeline parallelism; under async scheduling, not when its placeholders already reach a length
        limit (the step in flight may be its last)."""
        if not self.config.async_scheduling:
            return request.request_id not in self.in_flight
        pending = request.num_output_placeholders
        if request.grammar is not None:
            return pending == 0  # its bitmask needs the token in flight
        return pending == 0 or (request.num_output_tokens + pending < request.max_tokens
                                and request.num_tokens + pending < self.config.max_model_len)

    def _drafts_to_schedule(self, request: Request) -> list[int]:
        """The request's drafts that could still be accepted: one sampled token always follows them, and
        neither max_model_len nor max_tokens may be passed."""
        if not request.spec_token_ids:
            return []
        room = min(self.config.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens) - 1
        return request.spec_token_ids[:max(room, 0)]

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[NewRequestData]) -> int:
        compiling: list[Request] = []  # constrained requests passed over: they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not self._grammar_ready(request):
                if request.is_finished:
                    continue
                compiling.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            lookahead = self.config.num_lookahead_tokens if num_new == request.num_tokens - num_hit_tokens else 0
            if self.kv.allocate_slots(request, num_new, hits, lookahead) is None:
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if self.config.trace_requests:
                request.add_trace("resumed" if request.num_preemptions else "scheduled",
                                  prompt_tokens=request.num_prompt_tokens, prefix_hit_tokens=num_hit_tokens)
            request.status = RequestStatus.RUNNING
            request.record_event(EventType.SCHEDULED)
            self.running.append(request)
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
            ))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return budget

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a constrained request's grammar is compiled; one that failed to compile is ended
        (removed from the waiting queue, its output queued for the next step's outputs)."""
        try:
            return self.structured_output.is_ready(request)
        except ValueError as exc:
            self.waiting.popleft()
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = str(exc)
            self._free_request(request)
            self._ended_outside_step.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                stop_reason=str(exc), events=request.take_events()))
            return False

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_output_placeholders = 0  # the results of its step in flight will be dropped
        request.num_preemptions += 1
        request.record_event(EventType.PREEMPTED)
        if self.config.trace_requests:
            request.add_trace("preempted", kv_cache_usage=round(self.kv.usage, 4))
        self.waiting.appendleft(request)
        self.num_preemptions_total += 1
        self._step_preemptions += 1

    # ---- results of a step ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                           step: StepTrace | None = None) -> EngineCoreOutputs:
        """Apply a step's results. `step`: its start and scheduling time (None: the step is not timed)."""
        outputs, self._ended_outside_step = self._ended_outside_step, []
        num_generated = 0
        if step is not None and self.config.trace_requests:
            self._trace_step(scheduler_output, runner_output, step)
        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        prompt_logprobs = self._take_prompt_logprobs(runner_output)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        proposals = runner_output.spec_token_ids
        for i, (request_id, token_ids, logprobs) in enumerate(zip(runner_output.req_ids,
                                                                  runner_output.sampled_token_ids,
                                                                  runner_output.logprobs)):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted while its step ran, or preempted (async scheduling)
            if self.config.async_scheduling:
                request.num_output_placeholders -= 1
            if request_id in drafts:
                self._roll_back_rejected(request, len(drafts[request_id]), len(token_ids) - 1)
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break
            num_generated += len(new_token_ids)
            if request.grammar is not None:
                request.grammar.accept(new_token_ids)
            if request.is_finished and self.config.trace_requests:
                request.add_trace("finished", reason=str(request.status.finish_reason),
                                  output_tokens=request.num_output_tokens)
            if request.is_finished:
                self.running.remove(request)
                self._free_request(request)
            elif proposals:
                request.spec_token_ids = (proposals[i] if request.grammar is None
                                          else request.grammar.valid_prefix(proposals[i]))
            outputs.append(EngineCoreOutput(
                request_id=request_id,
                new_token_ids=new_token_ids,
                new_logprobs=logprobs,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                events=request.take_events(),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                new_prompt_logprobs=prompt_logprobs.pop(request_id, None),
                trace=request.take_trace(),
            ))
        for request_id, rows in prompt_logprobs.items():  # partial prefill chunks: nothing sampled
            request = self.requests[request_id]
            outputs.append(EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                events=request.take_events(),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                new_prompt_logprobs=rows,
                trace=request.take_trace(),
            ))
        stats = self.make_stats(num_generated, step_stats(scheduler_output, runner_output, step))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _trace_step(self, so: SchedulerOutput, ro: ModelRunnerOutput, step: StepTrace) -> None:
        """A `step` event for every live request the step computed tokens for."""
        timings = ro.timings
        split = {"schedule_ms": round(step.schedule_s * 1e3, 3)}
        if timings is not None:
            split.update(prepare_ms=round(timings.prepare_s * 1e3, 3), forward_ms=round(timings.forward_s * 1e3, 3),
                         sample_ms=round(timings.sample_s * 1e3, 3))
        for request_id, n in so.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            drafts = len(so.scheduled_spec_decode_tokens.get(request_id, ()))
            # At the end of its scheduling (after a `scheduled` event of the same step): the work for it begins.
            request.add_trace("step", step.start + step.schedule_s, tokens=n, drafts=drafts,
                              batch_requests=len(so.num_scheduled_tokens), batch_tokens=so.total_num_scheduled_tokens,
                              **split)

    def _roll_back_rejected(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step computed KV for every draft; only the accepted ones stay computed."""
        request.num_computed_tokens -= num_drafts - num_accepted
        stats = self._spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1

    def _take_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> dict[str, Logprobs]:
        """The step's prompt-logprob rows of live requests, without the positions already sent."""
        taken: dict[str, Logprobs] = {}
        for request_id, (first, rows) in runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            skip = request.num_prompt_logprobs_sent + 1 - first
            assert skip >= 0, (request_id, first, request.num_prompt_logprobs_sent)  # no gap
            if skip >= len(rows.ranks):
                continue
            if skip:
                rows = Logprobs(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])
            request.num_prompt_logprobs_sent += len(rows.ranks)
            taken[request_id] = rows
        return taken

    def _check_stop(self, request: Request) -> bool:
        """Set the finished status if the request's newest token ends it (vLLM's order: length
        limits first, then EOS and stop token ids once min_tokens are out)."""
        if (request.num_tokens >= self.config.max_model_len
                or request.num_output_tokens >= request.max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return False
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    def _free_request(self, request: Request) -> None:
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def make_stats(self, num_generated: int = 0, step: StepStats | None = None) -> SchedulerStats:
        queries, hits = self.kv.take_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self._step_preemptions,
            num_prompt_tokens=self._step_prompt_tokens,
            num_generation_tokens=num_generated,
            spec_decoding=self._take_spec_stats(),
            step=step,
        )
        self._step_preemptions = self._step_prompt_tokens = 0
        return stats

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        stats = self._spec_stats
        if stats is None or not stats.num_drafts:
            return None
        self._spec_stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * self.config.num_speculative_tokens)
        return stats
