"""What every OpenAI endpoint shares: errors in OpenAI's shape, reading and checking a request body,
tokenizing off the event loop, the admission limit, handing requests to the engine, SSE streams.

Every error is OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`: 400 for bad input
(malformed or too deeply nested JSON, wrong types, invalid values, prompt + max_tokens over
max_model_len), 413 for an oversized body, 429 when the queue is full, 500 for a request the engine
failed while running it, 503 once the engine no longer serves. No bad input gives a 5xx.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from kestrel.engine.exceptions import EngineDeadError, EngineStoppedError
from kestrel.engine.tracing import API_SERVER
from kestrel.entrypoints.openai.metrics import ServerMetrics
from kestrel.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    ChatCompletionRequest,
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    SamplingFields,
    TokenizeRequest,
)
from kestrel.entrypoints.openai.tool_parsers import HermesToolParser, ToolParser
from kestrel.entrypoints.openai.tool_parsers.template import for_template, message_extras
from kestrel.outputs import RequestOutput
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1
# Bodies larger than this are parsed off the event loop (json.loads of 8 MiB takes tens of ms).
PARSE_IN_THREAD_BYTES = 1 << 20

T = TypeVar("T")
VOCAB_CHECKED_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words")


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


def engine_error(exc: Exception) -> APIError | None:
    """The HTTP answer for a request the engine ended with an error; None if `exc` is not one."""
    if isinstance(exc, EngineDeadError):
        return APIError(f"the engine failed while running this request: {exc}", 500)
    if isinstance(exc, EngineStoppedError):
        return APIError(f"the request failed: {exc}", 503)
    return None


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (loc[0] if loc else None)


# ---- reading a request ----------------------------------------------------------------------------

async def read_json(request: Request, max_body_bytes: int) -> Any:
    check_json_content_type(request.headers.get("content-type"))
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise APIError(f"request body exceeds the limit of {max_body_bytes} bytes", 413)
    if len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json, bytes(body))
    return parse_json(body)


def check_json_content_type(content_type: str | None) -> None:
    """A body sent as another media type (a form, text) is a 400, as vLLM's, not read as JSON.
    No Content-Type at all is read as JSON (curl -d without -H, raw clients)."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(f"unsupported media type {media_type!r}: only 'application/json' is accepted", 400)


def parse_json(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"malformed JSON body: {e}") from None
    except RecursionError:
        # `[[[[...]]]]` deeper than the interpreter's recursion limit: the caller's input, not our fault.
        raise APIError("malformed JSON body: it is nested too deeply") from None


def parse_body(model: type[BaseModel], obj: Any) -> Any:
    if not isinstance(obj, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(message, 400, param) from None
    except RecursionError:
        raise APIError("the request body is nested too deeply") from None


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be given when stream is true", 400, "stream_options")


def sampling_params_from(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                         max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
    kw: dict[str, Any] = dict(n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
                              ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs,
                              skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                              stop_token_ids=list(req.stop_token_ids or []),
                              logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
                              bad_words=req.bad_words, best_of=getattr(req, "best_of", None))
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
    if kw["best_of"] is not None and kw["best_of"] > MAX_N:
        raise APIError(f"best_of must be at most {MAX_N}, got {kw['best_of']}", 400, "best_of")
    if logprobs is not None and logprobs > max_logprobs:
        raise APIError(f"logprobs must be at most {max_logprobs}, got {logprobs}", 400, "logprobs")
    kw["structured_outputs"] = structured_outputs_from(req)
    try:
        params = SamplingParams(**kw)
        params.validate()
    except ValueError as e:
        raise APIError(str(e), 400, str(e).split(" ", 1)[0]) from None
    return params


def structured_outputs_from(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from vLLM's `structured_outputs` or OpenAI's `response_format`
    (not both)."""
    fmt, so = req.response_format, req.structured_outputs
    from_format = None
    if fmt is not None and fmt.type == "json_object":
        from_format = StructuredOutputsParams(json_object=True)
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format of type json_schema needs json_schema.schema", 400, "response_format")
        from_format = StructuredOutputsParams(json=json.dumps(fmt.json_schema.schema_))
    if so is None:
        return from_format
    if from_format is not None:
        raise APIError("set either response_format or structured_outputs, not both", 400, "structured_outputs")
    schema = so.json_ if isinstance(so.json_, str) or so.json_ is None else json.dumps(so.json_)
    params = StructuredOutputsParams(json=schema, json_object=bool(so.json_object), regex=so.regex,
                                     choice=so.choice, grammar=so.grammar)
    try:
        params.kind_and_spec()
    except ValueError as e:
        raise APIError(str(e), 400, "structured_outputs") from None
    return params


def template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict | None:
    """The chat template's keyword arguments: the request's, and `continue_final_message`."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true", 400,
                       "continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs or None


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


# ---- admission ------------------------------------------------------------------------------------

class QueueLimit:
    """`--max-queued-requests`: answer 429 while this many accepted requests have no output yet.

    A request counts from its admission, first here (`num_preparing`, while its prompt is tokenized
    off the event loop and others are admitted meanwhile), then in the engine
    (`AsyncLLM.num_waiting_requests`) from the moment it is added there until its first output."""

    def __init__(self, engine, limit: int | None) -> None:
        self.engine, self.limit = engine, limit
        self.num_preparing = 0

    def admit(self) -> Admission:
        if self.limit is not None and self.engine.num_waiting_requests + self.num_preparing >= self.limit:
            raise APIError(f"the server is at its limit of {self.limit} queued requests; retry later", 429)
        self.num_preparing += 1
        return Admission(self)


class Admission:
    """One admitted request's place in `QueueLimit.num_preparing`; released once, by whichever comes
    first: its hand-over to the engine, or the end of its handler."""
    __slots__ = ("limit", "released")

    def __init__(self, limit: QueueLimit) -> None:
        self.limit, self.released = limit, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limit.num_preparing -= 1


# ---- async helpers --------------------------------------------------------------------------------

async def merge(iterators: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave async iterators, yielding (index, item); cancels the rest if one fails or the
    consumer stops (which aborts their requests)."""
    if len(iterators) == 1:
        # One request (n samples of one prompt included): no task and queue to hop through per item.
        only = iterators[0]
        try:
            async for item in only:
                yield 0, item
        finally:
            await only.aclose()  # aborts its request if the consumer stopped early
        return
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


# ---- the base of every endpoint's serving class ----------------------------------------------------

class OpenAIServing:
    """Model checks, prompt tokenizing (in `tokenizer_pool`, never on the event loop), the hand-over
    to the engine, metrics, and SSE responses, for the endpoint classes built on it."""

    # The format of tools in a prompt whose chat template does not take them (tool_parsers/template.py):
    # the server's --tool-call-parser's.
    tool_format: type[ToolParser] = HermesToolParser
    # Server settings (`kestrel serve` flags, set by build_app): --max-logprobs (-1: the vocabulary),
    # --return-tokens-as-token-ids.
    max_logprobs: int = MAX_LOGPROBS
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details

    def __init__(self, engine, served_model_name: str, metrics: ServerMetrics,
                 tokenizer_pool: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_model_len = engine.config.model.max_model_len
        self.vocab_size = engine.config.model.vocab_size
        self.tokenizer = engine.tokenizer
        self.tokenizer_pool = tokenizer_pool

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn` (tokenizing, templating, decoding long inputs) on the tokenizer thread, so that a
        5 MB prompt does not stop the event loop from answering /health and the other requests."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, functools.partial(fn, *args, **kwargs))

    # -- input ------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        # "" (as None) means the served model, as vLLM's.
        if model and model not in (self.model_name,):
            raise APIError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           404, "model")

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is out of range for a vocabulary of {self.vocab_size}", 400, param)

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        kwargs: dict[str, Any] | None = None, limit: int | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template applied and tokenized (blocking: call through `in_tokenizer_thread`);
        more than `limit` tokens is a 400. `tools`: the request's, for the template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template; use /v1/completions", 400, "messages")
        conversation = [{"role": m.role, "content": message_text(m)} for m in messages]
        try:
            conversation, tools = for_template(self.tokenizer.chat_template, [
                {**c, **message_extras(m)} for c, m in zip(conversation, messages)], tools, self.tool_format)
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools, **(kwargs or {}))
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(f"could not apply the chat template: {e}", 400, "messages") from None
        # As `apply_chat_template(tokenize=True)`: the template writes the special tokens itself.
        return self.prompt_ids(text, add_special_tokens=False, limit=limit, param="messages")

    def prompt_ids(self, text: str, add_special_tokens: bool, limit: int | None = None,
                   param: str = "prompt") -> list[int]:
        """`text` tokenized (blocking: call through `in_tokenizer_thread`); more than `limit` tokens is a
        400. The count is checked before the ids become a Python list: for a 5 MB prompt that list is a
        million ints, built holding the GIL for tens of milliseconds, which the event loop would feel."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (pure-Python) tokenizer
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
            self.check_prompt_length(len(ids), limit, param)
            return ids
        # encode_batch releases the GIL while it tokenizes; encode does not.
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        self.check_prompt_length(len(encoding), limit, param)
        return encoding.ids

    def check_prompt_length(self, n: int, limit: int | None, param: str) -> None:
        if limit is not None and n > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens, but the prompt has {n} "
                           "tokens", 400, param)

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
            # A sampling field the vocabulary rules out (logit_bias, allowed_token_ids, bad_words)
            # is named by its message's first word.
            field = str(e).split(" ", 1)[0]
            raise APIError(str(e), 400, field if field in VOCAB_CHECKED_FIELDS else None) from None

    async def generate(self, prompt: dict, params: SamplingParams, request_id: str, stream: bool,
                       admission: Admission, timeline: list[tuple[str, float]] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """`timeline`: the handler's events for the request's trace (received, tokenized)."""
        outputs = self.engine.generate(prompt, params, request_id, stream=stream, timeline=timeline)
        # The engine adds the request (and counts it as waiting) in its first step, which runs in
        # the same turn of the event loop as this line: the admission hands its place over without
        # a gap in which another request could slip past the limit.
        admission.release()
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()

    def resolve_logprobs(self, value: int | None, param: str) -> int | None:
        """A number of top logprobs as asked (-1: the whole vocabulary, as vLLM's), checked against
        --max-logprobs (-1: the vocabulary)."""
        if value is None:
            return None
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        n = self.vocab_size if value == -1 else value
        if n < 0:
            raise APIError(f"{param} must be non-negative or -1 (the whole vocabulary), got {value}", 400, param)
        if n > limit:
            raise APIError(f"{param}: requested {n} logprobs, which is more than the {limit} allowed "
                           "(--max-logprobs)", 400, param)
        return n

    def with_prompt_logprobs(self, params: SamplingParams, req: SamplingFields,
                             at_least: int | None = None) -> SamplingParams:
        """`params` asking for the request's `prompt_logprobs` (and at least `at_least` of them)."""
        n = self.resolve_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if at_least is not None:
            n = at_least if n is None else max(n, at_least)
        if n is None:
            return params
        params = params.clone(prompt_logprobs=n)
        try:
            params.validate()
        except ValueError as e:
            raise APIError(str(e), 400, "prompt_logprobs") from None
        return params

    def prompt_tokens_details(self, outs: list[RequestOutput]) -> PromptTokensDetails | None:
        if not self.enable_prompt_tokens_details:
            return None
        return PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outs))

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        return bool(req.return_tokens_as_token_ids or self.return_tokens_as_token_ids)

    def prompt_logprobs_out(self, prompt_logprobs: list | None, as_ids: bool = False) -> list | None:
        """The engine's prompt logprobs as vLLM returns them: per prompt token None (the first) or
        {token id: {logprob, rank, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        return [None if entry is None else
                {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                            "decoded_token": self.token_text(tid, lp, as_ids)} for tid, lp in entry.items()}
                for entry in prompt_logprobs]

    # -- output -----------------------------------------------------------------------------------

    def trace_event(self, request_ids: list[str], name: str) -> None:
        """Add an API-server event to these requests' traces (when request traces are on)."""
        for request_id in request_ids:
            trace = self.engine.trace_of(request_id)
            if trace is not None:
                trace.add(API_SERVER, name)

    def token_text(self, tid: int, lp, as_ids: bool = False) -> str:
        if as_ids:  # return_tokens_as_token_ids, as vLLM writes them
            return f"token_id:{tid}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid])

    def observe(self, out: RequestOutput | None, num_tokens: int | None = None,
                params: SamplingParams | None = None) -> None:
        if out is None:
            return
        if num_tokens is None:
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.metrics.observe_finished(out.metrics, num_tokens, [c.finish_reason for c in out.outputs],
                                      num_prompt_tokens=len(out.prompt_token_ids),
                                      n=params.n if params is not None else None,
                                      max_tokens=params.max_tokens if params is not None else None)

    def stream_response(self, events: AsyncIterator[str], request_ids: list[str] = ()) -> StreamingResponse:
        """An SSE response; an error after the headers went out is one error event, then [DONE].
        `request_ids`: the engine requests it streams, whose traces get the last byte's time."""
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except Exception as e:  # noqa: BLE001 - the headers are sent; report in-band
                error = engine_error(e)
                if error is None:
                    logger.exception("streaming request failed")
                    error = APIError(f"the request failed: {e}", 503 if not self.engine.is_running else 500)
                yield sse(error_body(error.message, error.status))
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"
            self.trace_event(request_ids, "last_byte")

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
