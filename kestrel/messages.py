"""Every message that crosses a box boundary, in one module.

    front end ──EngineCoreRequest──► engine core ──SchedulerOutput──► worker
    front end ◄─EngineCoreOutputs─── engine core ◄─ModelRunnerOutput── worker
    front end ◄─EngineCoreFailure─── engine core   (once, when a step fails; then it exits)

Only token ids cross into the engine core, and only token ids, logprobs and stats come back. All are
msgspec structs so that they can be sent between processes unchanged (`array_like` keeps the
encoding compact).
"""

from __future__ import annotations

import enum

import msgspec

from kestrel.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------
# front end ⇄ engine core
# --------------------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    trace_context: dict[str, str] | None = None


class FinishReason(enum.IntEnum):
    STOP = 0    # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2   # the client went away or the request was cancelled
    ERROR = 3   # the engine failed while running it

    def __str__(self) -> str:
        return self.name.lower()


class EventType(enum.IntEnum):
    QUEUED = 0
    SCHEDULED = 1
    PREEMPTED = 2


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of the tokens generated in one step for one request, one row per token.

    Row i holds the sampled token first, then the top-N tokens; `ranks[i]` is the sampled token's
    rank (1 = most likely) in the full distribution.
    """
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class TraceEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """One timed event of a request in the engine core, for its trace (sent only with request traces
    on): queued, scheduled, resumed, preempted, step, finished. `time` is `time.monotonic()`, one clock
    for every process on the machine, so the front end can put these beside its own events."""
    name: str
    time: float
    attrs: dict[str, int | float | str] = msgspec.field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[tuple[EventType, float]] | None = None
    num_cached_tokens: int = 0
    # Prompt logprobs computed this step, one row per prompt token scored (actual token first), in
    # prompt order and continuing where the request's previous rows ended (the first prompt token
    # has none). A partial prefill chunk sends them with no new tokens.
    new_prompt_logprobs: Logprobs | None = None
    trace: list[TraceEvent] | None = None  # with request traces on: its events since its last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True):
    """Speculative decoding in one step, as vLLM counts it: a draft is one request's proposed tokens
    verified in one step; `num_accepted_tokens_per_pos[j]` counts drafts whose token j was accepted."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def add(self, other: SpecDecodingStats) -> None:
        """Count `other`'s drafts in too (totals over steps)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for j, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[j] += n


class StepStats(msgspec.Struct, array_like=True):
    """One engine step: its batch, and where its wall time went (seconds). `total_s` runs from the
    start of scheduling to the step's outputs; the phases are scheduling (engine core) and the
    worker's `StepTimings`, the rest being the engine core's bookkeeping and the transfers."""
    num_reqs: int = 0
    num_tokens: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in this step
    prefix_cache_hits: int = 0      # of which found cached
    num_preemptions: int = 0        # in this step
    num_prompt_tokens: int = 0      # computed in this step
    num_generation_tokens: int = 0  # sampled in this step
    spec_decoding: SpecDecodingStats | None = None  # None without speculative decoding
    step: StepStats | None = None  # None in a report that ran no step


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineCoreFailure(msgspec.Struct, array_like=True):
    """The engine core's last message: a step (or an input) raised, so it stops and exits non-zero.

    Every request it held ends here with `FinishReason.ERROR` (`outputs`); the front end fails their
    streams with `message` and refuses new requests."""
    message: str                    # the exception's type and text
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0          # engine-core monotonic clock


# --------------------------------------------------------------------------------------------
# engine core ⇄ worker
# --------------------------------------------------------------------------------------------


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen (or has dropped after a preemption)."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after a preemption
    sampling_params: SamplingParams
    eos_token_id: int | None  # masked while fewer than min_tokens are generated
    block_ids: list[list[int]]  # per KV-cache group (kestrel.config.KVCacheGroups), its block table
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True):
    """Only what changed for requests the worker already holds."""
    req_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[list[int]]] = msgspec.field(default_factory=list)   # per request, per group
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # The sampled tokens among the ones this step computes (positions num_computed_tokens onward that
    # are past the prompt): a decode's input token. The rank that sampled it has it already; the
    # others (the other tensor ranks, earlier pipeline stages) learn it here.
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Tokens to compute per request this step, in batch order: decodes first, then prefill chunks.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must forget before this step (finished, aborted or preempted).
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Draft tokens to verify this step, per request: the last of its `num_scheduled_tokens` are these
    # (after the one sampled token that starts them).
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Structured outputs: the token bitmask of the constrained requests that sample this step (int32
    # words, ceil(vocab / 32) per row, xgrammar's layout), one row per sampled position (1 + drafts),
    # and each such request's first row.
    grammar_bitmask: bytes = b""
    structured_output_rows: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    # Requests that sampled a token this step (a partial prefill chunk samples nothing). With draft
    # tokens to verify, a request samples the accepted drafts and one more token.
    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None]
    # Requests that asked for prompt logprobs and computed prompt tokens this step (sampling or not):
    # req_id → (index in the prompt of the first token scored, one row per prompt token from there).
    prompt_logprobs: dict[str, tuple[int, Logprobs]] = msgspec.field(default_factory=dict)
    # Draft tokens proposed for the next step, per entry of `req_ids` (speculative decoding only).
    spec_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    timings: StepTimings | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])


class StepTimings(msgspec.Struct, array_like=True):
    """Where a step's time went in the worker (seconds): building the input tensors, the forward pass
    (with the draft model's mirror), logits and sampling (with verification and drafting)."""
    prepare_s: float
    forward_s: float
    sample_s: float
