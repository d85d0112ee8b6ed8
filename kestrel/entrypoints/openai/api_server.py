"""The OpenAI-compatible HTTP server: FastAPI routes over an `AsyncLLM`.

    build_app(engine, served_model_name, api_key=None) -> FastAPI
    run_server(args)   # `kestrel serve`: builds the AsyncLLM (engine core in its own process), runs uvicorn

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for bad input
(malformed JSON, wrong types, invalid values, prompt + max_tokens over max_model_len), 401 for a
missing or wrong API key on /v1/*, 404 for an unknown model, 413 for an oversized body, 503 when the
engine core is dead. No bad input gives a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import kestrel
from kestrel.engine.async_llm import EngineDeadError
from kestrel.entrypoints.openai.metrics import ServerMetrics
from kestrel.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TopLogprob,
    UsageInfo,
    random_id,
)
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
MAX_N = 128          # samples per prompt
MAX_LOGPROBS = 20    # top logprobs per token, as vLLM's default max_logprobs
INT64_MAX = 2**63 - 1


# ---- errors ---------------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, HTTPStatus(status).phrase),
                                         param=param, code=status)).model_dump()


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (loc[0] if loc else None)


# ---- helpers --------------------------------------------------------------------------------------

async def read_json(request: Request, max_body_bytes: int) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise APIError(f"request body exceeds the limit of {max_body_bytes} bytes", 413)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}") from None


def parse_body(model: type[BaseModel], obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param) from None


def sampling_params_from(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
                              ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs,
                              skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                              stop_token_ids=list(req.stop_token_ids or []))
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    # Bounds that keep one request from swamping or breaking the engine core.
    for name, value in kw.items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, int) and not -INT64_MAX <= v <= INT64_MAX for v in values):
            raise APIError(f"{name} is out of range, got {value!r}", 400, name)
    if req.n > MAX_N:
        raise APIError(f"n must be at most {MAX_N}, got {req.n}", 400, "n")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise APIError(f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}", 400, "logprobs")
    params = SamplingParams(**kw)
    try:
        params.validate()
    except ValueError as e:
        raise APIError(str(e), 400, str(e).split(" ", 1)[0]) from None
    return params


def message_text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"only text content parts are supported, got {part.get('type')!r}", 400, "messages")
        parts.append(part["text"])
    return "".join(parts)


async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators, yielding (index, item); cancels the rest if one fails or the
    consumer stops (which aborts their requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, done, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request) -> None:
    """Return when the client goes away (call only once the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, coro) -> Any:
    """Run a non-streaming handler, cancelling it (and so aborting its requests in the engine core)
    if the client disconnects first. Streaming responses watch for the disconnect themselves."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        # Nobody is listening; 499 as nginx logs it ("client closed request").
        return Response(status_code=499)
    return work.result()


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


# ---- the app --------------------------------------------------------------------------------------

class OpenAIServing:
    def __init__(self, engine, served_model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_model_len = engine.config.model.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.tokenizer = engine.tokenizer

    # -- input ------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name,):
            raise APIError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           404, "model")

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range for a vocabulary of {self.vocab_size}", 400, param)

    def completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
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
                out.append((p, self.tokenizer.encode(p, add_special_tokens=True)))
            else:
                if not p:
                    raise APIError("prompt is empty (it has no tokens)", 400, "prompt")
                self.check_ids(p)
                out.append((None, list(p)))
        return out

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        kwargs: dict[str, Any] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template; use /v1/completions", 400, "messages")
        conversation = [{"role": m.role, "content": message_text(m)} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, return_dict=False, **(kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(f"could not apply the chat template: {e}", 400, "messages") from None
        return list(ids)

    def resolve_max_tokens(self, max_tokens: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"{param} must be at least 1, got {max_tokens}", 400, param)
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise APIError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                               f"prompt has {prompt_len} tokens, which leaves no room to generate", 400, "prompt")
            return self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                           f"{prompt_len} prompt tokens and asks for {max_tokens} completion tokens "
                           f"({prompt_len + max_tokens} in total)", 400, param)
        return max_tokens

    def validate(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        try:
            self.engine.processor.process(request_id, prompt, params)
        except ValueError as e:
            raise APIError(str(e), 400) from None

    def generate(self, prompt: dict, params: SamplingParams, request_id: str, stream: bool) -> AsyncIterator:
        return self.engine.generate(prompt, params, request_id, stream=stream)

    # -- logprobs ---------------------------------------------------------------------------------

    def token_text(self, tid: int, lp) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid])

    def completion_logprobs(self, c: CompletionOutput, offset: int, prompt_ids: list[int] | None = None,
                            prompt_logprobs: list | None = None) -> tuple[CompletionLogprobs, int]:
        """Echoed prompt tokens (scored from `prompt_logprobs` where given; the first prompt token
        never is), then the generated ones."""
        out = CompletionLogprobs()
        for k, tid in enumerate(prompt_ids or []):
            entry = prompt_logprobs[k] if prompt_logprobs is not None and k < len(prompt_logprobs) else None
            lp = entry.get(tid) if entry is not None else None
            tok = self.token_text(tid, lp)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self.token_text(t, v): v.logprob for t, v in entry.items()}
                                    if entry is not None else None)
            out.text_offset.append(offset)
            offset += len(tok)
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self.token_text(tid, lp)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.top_logprobs.append({self.token_text(t, v): v.logprob for t, v in entry.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out, offset

    def chat_logprobs(self, c: CompletionOutput, top: int) -> ChatChoiceLogprobs:
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self.token_text(tid, lp)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top]
            content.append(ChatTokenLogprob(
                token=tok, logprob=lp.logprob if lp is not None else float("-inf"), bytes=list(tok.encode()),
                top_logprobs=[TopLogprob(token=(t := self.token_text(i, v)), logprob=v.logprob,
                                         bytes=list(t.encode())) for i, v in ranked]))
        return ChatChoiceLogprobs(content=content)

    # -- completions ------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest):
        self.check_model(req.model)
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(f"logprobs must be non-negative, got {req.logprobs}", 400, "logprobs")
        prompts = self.completion_prompts(req.prompt)
        request_id = random_id("cmpl")
        jobs = []
        for i, (text, ids) in enumerate(prompts):
            params = sampling_params_from(req, self.resolve_max_tokens(req.max_tokens, len(ids)), req.logprobs)
            if req.echo and req.logprobs is not None:  # the echoed prompt tokens get logprobs too
                params = params.clone(prompt_logprobs=req.logprobs)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            self.validate(f"{request_id}-{i}", prompt, params)
            jobs.append((f"{request_id}-{i}", prompt, params, text, ids))
        created, n = int(time.time()), req.n

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(self._completion_stream(req, jobs, request_id, created, n, include_usage))

        iters = [self.generate(p, sp, rid, stream=False) for rid, p, sp, _, _ in jobs]
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(iters):
            finals[i] = out
        choices, usage = [], UsageInfo()
        for i, (_, _, _, text, ids) in enumerate(jobs):
            out = finals[i]
            usage.prompt_tokens += len(ids)
            self.observe(out)
            for c in sorted(out.outputs, key=lambda c: c.index):
                usage.completion_tokens += len(c.token_ids)
                prefix = self.echo_text(text, ids) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs, _ = self.completion_logprobs(c, 0, ids if req.echo else None, out.prompt_logprobs)
                choices.append(CompletionChoice(index=i * n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=usage).model_dump()

    def echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    async def _completion_stream(self, req: CompletionRequest, jobs, request_id: str, created: int, n: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        iters = [self.generate(p, sp, rid, stream=True) for rid, p, sp, _, _ in jobs]
        offsets: dict[int, int] = {}
        started: set[int] = set()
        completion_tokens = 0
        ntokens: dict[int, int] = {}
        prompt_logprobs: dict[int, list] = {}  # per prompt: sent once, on its first output

        def chunk(choice: CompletionChoice) -> str:
            return sse(CompletionChunk(id=request_id, created=created, model=self.model_name, choices=[choice]))

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
                                                                        prompt_logprobs.get(i))
                yield chunk(CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs,
                                             finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if out.finished:
                self.observe(out, ntokens.get(i, 0))
        if include_usage:
            prompt_tokens = sum(len(j[4]) for j in jobs)
            yield sse(CompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                      usage=UsageInfo(prompt_tokens=prompt_tokens,
                                                      completion_tokens=completion_tokens,
                                                      total_tokens=prompt_tokens + completion_tokens)))

    # -- chat -------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", 400, "top_logprobs")
        ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        max_tokens, param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        top = req.top_logprobs or 0
        params = sampling_params_from(req, self.resolve_max_tokens(max_tokens, len(ids), param),
                                      top if req.logprobs else None)
        request_id = random_id("chatcmpl")
        prompt = {"prompt_token_ids": ids}
        self.validate(request_id, prompt, params)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(self._chat_stream(req, prompt, params, request_id, created, len(ids), top,
                                                  include_usage))
        final = None
        async for out in self.generate(prompt, params, request_id, stream=False):
            final = out
        self.observe(final)
        choices = [ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                        logprobs=self.chat_logprobs(c, top) if req.logprobs else None,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for c in sorted(final.outputs, key=lambda c: c.index)]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                      total_tokens=len(ids) + completion_tokens)).model_dump()

    async def _chat_stream(self, req: ChatCompletionRequest, prompt: dict, params: SamplingParams,
                           request_id: str, created: int, prompt_len: int, top: int,
                           include_usage: bool) -> AsyncIterator[str]:
        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[choice]))

        for i in range(params.n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        completion_tokens = 0
        async for out in self.generate(prompt, params, request_id, stream=True):
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                yield chunk(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text if (c.text or c.finish_reason is None) else None),
                    logprobs=self.chat_logprobs(c, top) if req.logprobs else None, finish_reason=c.finish_reason))
            if out.finished:
                self.observe(out, completion_tokens)
        if include_usage:
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                          usage=UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion_tokens,
                                                          total_tokens=prompt_len + completion_tokens)))

    # -- shared -----------------------------------------------------------------------------------

    def observe(self, out: RequestOutput | None, num_tokens: int | None = None) -> None:
        if out is None:
            return
        if num_tokens is None:
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.metrics.observe_finished(out.metrics, num_tokens, [c.finish_reason for c in out.outputs])

    def _stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except EngineDeadError as e:
                yield sse(error_body(f"the request failed: {e}", 503))
            except Exception as e:  # noqa: BLE001 - the headers are sent; report in-band
                logger.exception("streaming request failed")
                status = 503 if not self.engine.is_running else 500
                yield sse(error_body(f"the request failed: {e}", status))
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class GuardMiddleware:
    """API key on /v1/* and the body limit by Content-Length, as plain ASGI (no per-chunk overhead on
    streamed responses, unlike BaseHTTPMiddleware). Bodies without Content-Length are limited while
    they are read (read_json)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            rejection = self.check(scope)
            if rejection is not None:
                await rejection(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> JSONResponse | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
            if headers.get("authorization") != f"Bearer {self.api_key}":
                return error_response("missing or invalid API key; send 'Authorization: Bearer <key>'", 401)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return error_response("invalid Content-Length header", 400)
            if int(length) > self.max_body_bytes:
                return error_response(f"request body exceeds the limit of {self.max_body_bytes} bytes", 413)
        return None


def build_app(engine, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queued_requests: int | None = None) -> FastAPI:
    served_model_name = served_model_name or engine.model_name
    app = FastAPI(title="Kestrel OpenAI-compatible server", version=kestrel.__version__)
    metrics = ServerMetrics(engine, served_model_name)
    serving = OpenAIServing(engine, served_model_name, metrics)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        if not engine.is_running:
            return error_response(f"the engine is not running: {exc}", 503)
        logger.exception("request failed")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    async def run(coro):
        if not engine.is_running:
            raise APIError("the engine is not running", 503)
        if max_queued_requests is not None and engine.num_waiting_requests >= max_queued_requests:
            coro.close()
            raise APIError(f"the server is at its limit of {max_queued_requests} queued requests; retry later", 429)
        try:
            return await coro
        except ValueError as e:  # raised by the engine before it yields anything
            raise APIError(str(e), 400) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await read_json(request, max_body_bytes))
        result = await unless_disconnected(request, run(serving.completions(req)))
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await read_json(request, max_body_bytes))
        result = await unless_disconnected(request, run(serving.chat(req)))
        return result if isinstance(result, Response) else JSONResponse(result)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, root=engine.model_name,
                                         max_model_len=serving.max_model_len)]).model_dump()

    @app.get("/health")
    async def health():
        if engine.is_running:
            return Response(status_code=200)
        return error_response("the engine core is not running", 503)

    @app.get("/version")
    async def version():
        return {"version": kestrel.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_body(TokenizeRequest, await read_json(request, max_body_bytes))
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400, "prompt")
        if req.messages is not None:
            ids = serving.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            ids = serving.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(DetokenizeRequest, await read_json(request, max_body_bytes))
        serving.check_model(req.model)
        serving.check_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def run_server(args) -> int:
    """`kestrel serve`: start the engine core, then serve HTTP until SIGINT/SIGTERM."""
    from kestrel.config import EngineArgs
    from kestrel.engine.arg_utils import engine_kwargs
    from kestrel.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(args)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if kwargs.get("model") not in (None, tag):
            raise ValueError(f"two models given: {tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = tag
    api_key = args.api_key if args.api_key is not None else os.environ.get("KESTREL_API_KEY") or None
    engine = AsyncLLM.from_engine_args(EngineArgs(**kwargs))
    try:
        app = build_app(engine, args.served_model_name or engine.model_name, api_key=api_key,
                        max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=5)
        server = _Server(config, engine)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; end with exit code 0
        # through `finally` (which stops the engine core) instead of dying by the default handler.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGINT, _exit_on_signal)
        print(f"kestrel: serving {args.served_model_name or engine.model_name} on http://{args.host}:{args.port}",
              flush=True)
        server.run()
    finally:
        engine.shutdown()
    return 0


class _Server(uvicorn.Server):
    """uvicorn waits (up to timeout_graceful_shutdown) for open connections before it stops; end
    every in-flight request at once instead, each with one final error response (streams: an error
    event, then [DONE]), so shutdown is prompt and no request is lost silently."""

    def __init__(self, config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            loop.call_soon_threadsafe(self.engine.stop_requests, "the server is shutting down")
        super().handle_exit(sig, frame)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(0)
