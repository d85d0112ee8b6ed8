"""`/v1/chat/completions`: the model's chat template over the messages, `n` samples, logprobs,
streamed as SSE (a role chunk per sample first) or answered at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from kestrel.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
    random_id,
)
from kestrel.entrypoints.openai.serving_engine import (
    Admission,
    APIError,
    OpenAIServing,
    check_stream_options,
    message_text,
    sampling_params_from,
    sse,
    template_kwargs,
)
from kestrel.entrypoints.openai.serving_tools import (
    ToolPlan,
    ToolSettings,
    ToolStream,
    constrain,
    plan_tools,
    tool_message,
)
from kestrel.outputs import CompletionOutput
from kestrel.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    tool_settings = ToolSettings()  # build_app sets the server's

    async def chat(self, req: ChatCompletionRequest, admission: Admission):
        received = time.monotonic()
        self.check_model(req.model)
        check_stream_options(req)
        top = self.resolve_logprobs(req.top_logprobs, "top_logprobs") or 0
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", 400, "top_logprobs")
        tools = plan_tools(req, self.tool_settings)
        ids = await self.in_tokenizer_thread(self.chat_prompt_ids, req.messages, req.add_generation_prompt,
                                             template_kwargs(req), self.max_model_len, tools.template_tools())
        timeline = [("received", received), ("tokenized", time.monotonic())]
        max_tokens, param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        params = sampling_params_from(req, self.resolve_max_tokens(max_tokens, len(ids), param),
                                      top if req.logprobs else None,
                                      self.vocab_size if self.max_logprobs == -1 else self.max_logprobs)
        constrain(tools, params)
        params = self.with_prompt_logprobs(params, req)
        as_ids = self.tokens_as_ids(req)
        echo = echoed_text(req)
        request_id = random_id("chatcmpl")
        prompt = {"prompt_token_ids": ids}
        self.validate(request_id, prompt, params)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = include_usage and req.stream_options.continuous_usage_stats
            return self.stream_response(self._chat_stream(req, prompt, params, request_id, created, len(ids), top,
                                                          include_usage, admission, timeline, tools, as_ids, echo,
                                                          continuous), [request_id])
        final = None
        async for out in self.generate(prompt, params, request_id, False, admission, timeline):
            final = out
        self.observe(final, params=params)
        self.trace_event([request_id], "response_built")
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            content, tool_calls = tool_message(tools, c.text)
            if echo:
                content = echo + (content or "")
            choices.append(ChatCompletionChoice(
                index=c.index, message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                logprobs=self.chat_logprobs(c, top, as_ids) if req.logprobs else None,
                finish_reason=tools.finish_reason(c.finish_reason, bool(tool_calls)), stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                      total_tokens=len(ids) + completion_tokens,
                                                      prompt_tokens_details=self.prompt_tokens_details([final])),
                                      prompt_logprobs=(self.prompt_logprobs_out(final.prompt_logprobs, as_ids)
                                                       if req.prompt_logprobs is not None else None)).model_dump()

    def chat_logprobs(self, c: CompletionOutput, top: int, as_ids: bool = False) -> ChatChoiceLogprobs:
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self.token_text(tid, lp, as_ids)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
            content.append(ChatTokenLogprob(
                token=tok, logprob=lp.logprob if lp is not None else float("-inf"), bytes=list(tok.encode()),
                top_logprobs=[TopLogprob(token=(t := self.token_text(i, v, as_ids)), logprob=v.logprob,
                                         bytes=list(t.encode())) for i, v in ranked]))
        return ChatChoiceLogprobs(content=content)

    async def _chat_stream(self, req: ChatCompletionRequest, prompt: dict, params: SamplingParams,
                           request_id: str, created: int, prompt_len: int, top: int,
                           include_usage: bool, admission: Admission,
                           timeline: list[tuple[str, float]], tools: ToolPlan, as_ids: bool = False,
                           echo: str = "", continuous_usage: bool = False) -> AsyncIterator[str]:
        completion_tokens = 0

        def chunk(choice: ChatStreamChoice) -> str:
            # continuous_usage_stats: the usage so far on every chunk, as vLLM's.
            usage = (UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                               total_tokens=prompt_len + completion_tokens) if continuous_usage else None)
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[choice],
                                           usage=usage))

        for i in range(params.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        tool_streams = [ToolStream(tools) for _ in range(params.n)]
        if echo:  # the continued message first, as vLLM streams it
            for i in range(params.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=echo),
                                             logprobs=ChatChoiceLogprobs(content=[]) if req.logprobs else None))
        async for out in self.generate(prompt, params, request_id, True, admission, timeline):
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                stream = tool_streams[c.index]
                text, tool_calls = stream.step(c.text, c.finish_reason is not None)
                if stream.parser is not None and not text and not tool_calls and c.finish_reason is None \
                        and not req.logprobs:
                    continue  # text the tool parser holds back until it knows what it is
                content = text if (text or (c.finish_reason is None and not tool_calls)) else None
                yield chunk(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=content, tool_calls=tool_calls or None),
                    logprobs=self.chat_logprobs(c, top, as_ids) if req.logprobs else None,
                    finish_reason=tools.finish_reason(c.finish_reason, stream.called)))
            if out.finished:
                self.observe(out, completion_tokens, params)
        if include_usage:
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                          usage=UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                                                          total_tokens=prompt_len + completion_tokens)))


def echoed_text(req: ChatCompletionRequest) -> str:
    """`echo`: the last message's text when it is the assistant's (the one continued), as vLLM's."""
    if not req.echo or req.messages[-1].role != "assistant":
        return ""
    return message_text(req.messages[-1])
