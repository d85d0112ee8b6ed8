"""`/v1/completions`: one or several prompts (text or token ids), `n` samples each, echo, logprobs,
streamed as SSE or answered at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kestrel.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from kestrel.entrypoints.openai.serving_engine import (
    Admission,
    APIError,
    OpenAIServing,
    check_stream_options,
    merge,
    sampling_params_from,
    sse,
)
from kestrel.outputs import CompletionOutput, RequestOutput

# One prompt's request: (request id, engine prompt, sampling params, prompt text or None, prompt ids).
Job = tuple[str, dict, Any, str | None, list[int]]


class OpenAIServingCompletion(OpenAIServing):

    async def completions(self, req: CompletionRequest, admission: Admission):
        received = time.monotonic()
        self.check_model(req.model)
        check_stream_options(req)
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(f"logprobs must be non-negative, got {req.logprobs}", 400, "logprobs")
        if req.best_of is not None and req.best_of < req.n:
            raise APIError(f"best_of must be at least n ({req.n}), got {req.best_of}", 400, "best_of")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError(f"best_of ({req.best_of}) > n ({req.n}) cannot be streamed: the best samples are known "
                           "only at the end", 400, "best_of")
        prompts = await self.in_tokenizer_thread(self.completion_prompts, req.prompt)
        timeline = [("received", received), ("tokenized", time.monotonic())]
        request_id = random_id("cmpl")
        jobs: list[Job] = []
        for i, (text, ids) in enumerate(prompts):
            params = sampling_params_from(req, self.resolve_max_tokens(req.max_tokens, len(ids)), req.logprobs)
            # The echoed prompt tokens get logprobs too.
            params = self.with_prompt_logprobs(params, req, req.logprobs if req.echo else None)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            self.validate(f"{request_id}-{i}", prompt, params)
            jobs.append((f"{request_id}-{i}", prompt, params, text, ids))
        created, n = int(time.time()), req.n
        as_ids = self.tokens_as_ids(req)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and req.stream_options.continuous_usage_stats
            return self.stream_response(self._completion_stream(req, jobs, request_id, created, n, include_usage,
                                                                admission, timeline, as_ids, continuous),
                                        [job[0] for job in jobs])

        iters = [self.generate(p, sp, rid, False, admission, timeline) for rid, p, sp, _, _ in jobs]
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(iters):
            finals[i] = out
        choices, usage = [], UsageInfo()
        for i, (_, _, params, text, ids) in enumerate(jobs):
            out = finals[i]
            usage.prompt_tokens += len(ids)
            # Every sample's tokens, those best_of generated and dropped too (as OpenAI bills them).
            usage.completion_tokens += out.num_generated_tokens
            self.observe(out, out.num_generated_tokens, params)
            for c in sorted(out.outputs, key=lambda c: c.index):
                prefix = self.echo_text(text, ids) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs, _ = self.completion_logprobs(c, 0, ids if req.echo else None, out.prompt_logprobs,
                                                           as_ids)
                choices.append(CompletionChoice(
                    index=i * n + c.index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=(self.prompt_logprobs_out(out.prompt_logprobs, as_ids)
                                     if req.prompt_logprobs is not None else None)))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        usage.prompt_tokens_details = self.prompt_tokens_details(list(finals.values()))
        self.trace_event([job[0] for job in jobs], "response_built")
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=usage).model_dump()

    def completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt (blocking: call through `in_tokenizer_thread`)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt is empty", 400, "prompt")
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError("prompt is empty", 400, "prompt")
                out.append((p, self.prompt_ids(p, add_special_tokens=True, limit=self.max_model_len)))
            else:
                if not p:
                    raise APIError("prompt is empty (it has no tokens)", 400, "prompt")
                self.check_ids(p)
                out.append((None, list(p)))
        return out

    def echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def completion_logprobs(self, c: CompletionOutput, offset: int, prompt_ids: list[int] | None = None,
                            prompt_logprobs: list | None = None, as_ids: bool = False
                            ) -> tuple[CompletionLogprobs, int]:
        """Echoed prompt tokens (scored from `prompt_logprobs` where given; the first prompt token
        never is), then the generated ones."""
        out = CompletionLogprobs()
        for k, tid in enumerate(prompt_ids or []):
            entry = prompt_logprobs[k] if prompt_logprobs is not None and k < len(prompt_logprobs) else None
            lp = entry.get(tid) if entry is not None else None
            tok = self.token_text(tid, lp, as_ids)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self.token_text(t, v, as_ids): v.logprob for t, v in entry.items()}
                                    if entry is not None else None)
            out.text_offset.append(offset)
            offset += len(tok)
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self.token_text(tid, lp, as_ids)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self.token_text(t, v, as_ids): v.logprob for t, v in entry.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out, offset

    async def _completion_stream(self, req: CompletionRequest, jobs: list[Job], request_id: str, created: int,
                                 n: int, include_usage: bool, admission: Admission,
                                 timeline: list[tuple[str, float]], as_ids: bool = False,
                                 continuous_usage: bool = False) -> AsyncIterator[str]:
        iters = [self.generate(p, sp, rid, True, admission, timeline) for rid, p, sp, _, _ in jobs]
        offsets: dict[int, int] = {}
        started: set[int] = set()
        completion_tokens = 0
        ntokens: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}  # per prompt: sent once, on its first output
        sent_prompt_logprobs: set[int] = set()  # prompts whose prompt_logprobs went out (on their first chunk)

        prompt_tokens = sum(len(j[4]) for j in jobs)

        def chunk(choice: CompletionChoice) -> str:
            # continuous_usage_stats: the usage so far on every chunk, as vLLM's.
            usage = (UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                               total_tokens=prompt_tokens + completion_tokens) if continuous_usage else None)
            return sse(CompletionChunk(id=request_id, created=created, model=self.model_name, choices=[choice],
                                       usage=usage))

        async for i, out in merge(iters):
            text, ids = jobs[i][3], jobs[i][4]
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * n + c.index
                prefix, echo_ids = "", None
                if index not in started:
                    started.add(index)
                    if req.echo:
                        prefix, echo_ids = self.echo_text(text, ids), ids
                if not c.text and not c.token_ids and c.finish_reason is None and not prefix:
                    continue
                completion_tokens += len(c.token_ids)
                ntokens[i] = ntokens.get(i, 0) + len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offsets[index] = self.completion_logprobs(c, offsets.get(index, 0), echo_ids,
                                                                        prompt_logprobs.get(i), as_ids)
                # The prompt's logprobs once, on its first chunk that has them.
                send_prompt_logprobs = (req.prompt_logprobs is not None and i not in sent_prompt_logprobs
                                        and prompt_logprobs.get(i) is not None)
                if send_prompt_logprobs:
                    sent_prompt_logprobs.add(i)
                yield chunk(CompletionChoice(
                    index=index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=(self.prompt_logprobs_out(prompt_logprobs[i], as_ids)
                                     if send_prompt_logprobs else None)))
            if out.finished:
                self.observe(out, ntokens.get(i, 0), jobs[i][2])
        if include_usage:
            yield sse(CompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                      usage=UsageInfo(prompt_tokens=prompt_tokens,
                                                      completion_tokens=completion_tokens,
                                                      total_tokens=prompt_tokens + completion_tokens)))
