"""Output processing in the front end: token ids from the engine core → text and `RequestOutput`s.

Owns one state per user request (its `n` samples are child requests in the engine core), the
incremental detokenizers and stop strings. A stop string ends a sample here; the engine core is then
told to abort that child.

Prompt logprobs arrive chunk by chunk (only the first child of an `n > 1` request computes them,
see processor.py) and are exposed on `RequestOutput.prompt_logprobs` once the whole prompt is in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from kestrel.engine.detokenizer import IncrementalDetokenizer
from kestrel.engine.tracing import API_SERVER, ENGINE_CORE, RequestTrace
from kestrel.messages import EngineCoreOutput, EventType, FinishReason, Logprobs
from kestrel.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kestrel.sampling_params import SamplingParams

MAX_RECORDED_GAPS = 8192  # inter-token gaps kept per request, for the latency histogram


class RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, child_ids: list[str], tokenizer, arrival_time: float,
                 trace: RequestTrace | None = None) -> None:
        self.request_id = request_id
        self.trace = trace        # with request traces on
        self.engine_index = 0     # the engine core that runs it (set when it is sent)
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.child_index = {cid: i for i, cid in enumerate(child_ids)}
        # best_of > n: the children are ranked by cumulative logprob, tracked even if not asked for.
        self.ranked = len(child_ids) > params.n
        tracked = params.logprobs is not None or self.ranked
        self.completions = [CompletionOutput(i, "", [], 0.0 if tracked else None, [] if tracked else None)
                            for i in range(len(child_ids))]
        self.detokenizers = [IncrementalDetokenizer(tokenizer, params) for _ in child_ids]
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self._queued_at: float | None = None   # engine-core monotonic clock
        self.num_cached_tokens = 0
        # Prompt logprobs received so far, one dict per prompt token from the second on.
        self.prompt_logprob_rows: list[dict[int, Logprob]] | None = (
            [] if params.prompt_logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def unfinished_child_ids(self) -> list[str]:
        return [cid for cid, i in self.child_index.items() if not self.completions[i].finished]

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape: None for the first prompt token, then one dict per token; None until the
        whole prompt has been scored."""
        rows = self.prompt_logprob_rows
        if rows is None or len(rows) < len(self.prompt_token_ids) - 1:
            return None
        return [None, *rows]

    def to_output(self) -> RequestOutput:
        num_generated = sum(len(c.token_ids) for c in self.completions)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.best_completions(),
                             self.finished, self.num_cached_tokens, self.metrics, self.prompt_logprobs,
                             num_generated)

    def best_completions(self) -> list[CompletionOutput]:
        """Every sample; with best_of > n, the n with the highest cumulative logprob (so far, until
        all are finished), best first and indexed 0..n-1, as vLLM and OpenAI's best_of. Their
        logprobs are dropped if the request did not ask for them."""
        if not self.ranked:
            return self.completions
        ranked = sorted(self.completions, key=lambda c: -c.cumulative_logprob)[:self.params.n]
        asked = self.params.logprobs is not None
        return [replace(c, index=i, cumulative_logprob=c.cumulative_logprob if asked else None,
                        logprobs=c.logprobs if asked else None) for i, c in enumerate(ranked)]

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one engine-core output; True if the child ended here by a stop string (so the
        engine core must abort it)."""
        i = self.child_index[out.request_id]
        completion, detok = self.completions[i], self.detokenizers[i]
        if completion.finished:
            return False
        now = time.time()
        self._record_timing(out, now)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.new_prompt_logprobs is not None and self.prompt_logprob_rows is not None:
            self.prompt_logprob_rows.extend(self._logprob_dicts(out.new_prompt_logprobs))
        completion.text += detok.update(out.new_token_ids)
        # Tokens after the one that completed a stop string are dropped, as if never sampled.
        kept = detok.num_consumed
        completion.token_ids.extend(out.new_token_ids[:kept])
        if out.new_logprobs is not None and completion.logprobs is not None:
            lp = out.new_logprobs
            if kept < len(lp.ranks):
                lp = Logprobs(lp.token_ids[:kept], lp.logprobs[:kept], lp.ranks[:kept])
            self._append_logprobs(completion, lp)
        stopped_by_string = detok.stop_reason is not None and out.finish_reason is None
        if detok.stop_reason is not None:
            completion.finish_reason, completion.stop_reason = str(FinishReason.STOP), detok.stop_reason
        elif out.finish_reason is not None:
            completion.text += detok.flush()
            completion.finish_reason, completion.stop_reason = str(out.finish_reason), out.stop_reason
        if self.finished:
            self.metrics.finished_time = now
            if self.trace is not None:
                self.trace.add(API_SERVER, "completed")
        return stopped_by_string

    def _record_timing(self, out: EngineCoreOutput, now: float) -> None:
        m = self.metrics
        for event, timestamp in out.events or ():
            if event == EventType.QUEUED:
                self._queued_at = timestamp
                if self.trace is not None:
                    self.trace.add(ENGINE_CORE, "queued", timestamp, engine=self.engine_index)
            elif event == EventType.SCHEDULED and m.queue_time is None and self._queued_at is not None:
                m.queue_time = max(timestamp - self._queued_at, 0.0)
        if self.trace is not None and out.trace:
            self.trace.add_engine_events(out.trace, self.engine_index)
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
                if self.trace is not None:
                    self.trace.add(API_SERVER, "first_token")
            elif m.last_token_time is not None and len(m.inter_token_latencies) < MAX_RECORDED_GAPS:
                m.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now

    def _append_logprobs(self, completion: CompletionOutput, lp: Logprobs) -> None:
        completion.logprobs.extend(self._logprob_dicts(lp))
        for values in lp.logprobs:
            completion.cumulative_logprob += values[0]

    def _logprob_dicts(self, lp: Logprobs) -> list[dict[int, Logprob]]:
        """One dict per row: the row's own token (with its rank), then the top-N (rank = place)."""
        decoded: dict[int, str] = {}
        entries = []
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            entry: dict[int, Logprob] = {}
            for j, (tid, value) in enumerate(zip(ids, values)):
                if tid not in entry:
                    if tid not in decoded:
                        decoded[tid] = self.tokenizer.decode([tid])
                    entry[tid] = Logprob(value, rank if j == 0 else j, decoded[tid])
            entries.append(entry)
        return entries


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)   # child ids, for the engine core


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], arrival_time: float,
                    trace: RequestTrace | None = None) -> RequestState:
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, child_ids,
                                                       self.tokenizer, arrival_time, trace)
        for cid in child_ids:
            self.parent_of[cid] = request_id
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests; returns the child ids the engine core must abort."""
        children: list[str] = []
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                children.extend(state.unfinished_child_ids())
                for cid in state.child_index:
                    self.parent_of.pop(cid, None)
        return children

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, RequestState] = {}
        for out in outputs:
            parent = self.parent_of.get(out.request_id)
            if parent is None:
                continue  # aborted here while the engine core was still running it
            state = self.states[parent]
            if state.update(out):
                result.reqs_to_abort.append(out.request_id)
            if out.new_token_ids or out.finished:
                touched[parent] = state
            # else a partial prefill chunk's prompt logprobs: kept, nothing to show yet
        for rid, state in touched.items():
            result.request_outputs.append(state.to_output())
            if state.finished:
                del self.states[rid]
                for cid in state.child_index:
                    self.parent_of.pop(cid, None)
        return result
