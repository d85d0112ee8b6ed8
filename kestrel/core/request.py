"""A request as the engine core sees it: token ids, progress and status. No text."""

from __future__ import annotations

import enum
import time

from kestrel.messages import EngineCoreRequest, EventType, FinishReason, TraceEvent
from kestrel.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """Invariant: `num_computed_tokens <= num_tokens`; the KV of the first `num_computed_tokens`
    tokens is in this request's blocks. The scheduler's one rule is to move `num_computed_tokens`
    toward `num_tokens`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, arrival_time: float | None = None, priority: int = 0,
                 max_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        # The scheduler resolves None (up to max_model_len) when it admits the request.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 until then
        self.num_preemptions = 0
        # Prompt tokens whose prompt logprobs went out (the first has none, so at most prompt - 1);
        # after a preemption recomputes the prompt, only the rest are sent.
        self.num_prompt_logprobs_sent = 0
        self.block_hashes: list[bytes] = []  # chained hashes of this request's full blocks
        # Draft tokens proposed after its last step, to verify in its next one. Never part of
        # `all_token_ids` (nor of a block hash) until the model accepts them.
        self.spec_token_ids: list[int] = []
        # A constrained request's grammar and matcher (`RequestGrammar`, core/structured_output.py).
        self.grammar = None
        # Under async scheduling: tokens being sampled by steps that have not come back yet. The request
        # may be scheduled again as if they were known (the worker has them by the time it runs).
        self.num_output_placeholders = 0
        self.events: list[tuple[EventType, float]] = [(EventType.QUEUED, time.monotonic())]
        # With request traces on: timed events not sent to the front end yet (the scheduler adds them).
        self.trace: list[TraceEvent] = []

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_id,
                   req.arrival_time, req.priority)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def record_event(self, event: EventType) -> None:
        self.events.append((event, time.monotonic()))

    def take_events(self) -> list[tuple[EventType, float]] | None:
        events, self.events = self.events, []
        return events or None

    def add_trace(self, name: str, at: float | None = None, **attrs: int | float | str) -> None:
        self.trace.append(TraceEvent(name, time.monotonic() if at is None else at, attrs))

    def take_trace(self) -> list[TraceEvent] | None:
        trace, self.trace = self.trace, []
        return trace or None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}"
                f"/{self.num_tokens})")
