"""What the front end hands back to users, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id → its Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float                     # time.time() when the front end accepted the request
    first_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None         # seconds from queued to first scheduled, engine-core clock
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between output steps


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = field(default=None)
    # Tokens generated for the request by all its samples: with best_of > n, more than `outputs` hold.
    num_generated_tokens: int | None = None
