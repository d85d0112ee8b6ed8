"""The OpenAI-compatible HTTP server: the FastAPI app, its routes and its lifecycle, over an `AsyncLLM`.

    build_app(engine, served_model_name, api_key=None) -> FastAPI
    run_server(args)   # `kestrel serve`: builds the AsyncLLM (engine core in its own process), runs uvicorn

Each endpoint's work lives in its own module (serving_completion.py, serving_chat.py,
serving_tokenization.py), on what they share (serving_engine.py: errors, body parsing, admission,
tokenizing off the event loop, SSE). Errors are OpenAI-shaped (see serving_engine.py); 401 for a
missing or wrong API key on /v1/*.

If an engine core fails (a step raises) or its process dies (with `-dp D`, any one of the D), every
in-flight request ends at once with an error (500, or an error event on a stream), /health and new
requests answer 503, and after `ENGINE_DEATH_EXIT_DELAY_S` the server exits with code 1, so that a
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import kestrel
from kestrel import envs
from kestrel.distributed.lifecycle import freeze_startup_heap
from kestrel.entrypoints.openai.dashboard import dashboard_router
from kestrel.entrypoints.openai.metrics import ServerMetrics
from kestrel.entrypoints.openai.openapi import (
    GENERATION_ERRORS,
    add_models,
    error_responses,
    json_or_event_stream,
    request_body,
)
from kestrel.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadResponse,
    ModelCard,
    ModelList,
    RequestTraceResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kestrel.entrypoints.openai.serving_chat import OpenAIServingChat
from kestrel.entrypoints.openai.serving_completion import OpenAIServingCompletion
from kestrel.entrypoints.openai.serving_engine import (
    APIError,
    QueueLimit,
    engine_error,
    error_response,
    parse_body,
    read_json,
    unless_disconnected,
    validation_message,
)
from kestrel.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from kestrel.entrypoints.openai.serving_tools import ToolSettings
from kestrel.ops.huge_pages import return_freed_memory

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 << 20
# Between the engine's failure and the server's exit: in-flight requests get their errors, and a
# load balancer polling /health sees 503, before the port closes.
ENGINE_DEATH_EXIT_DELAY_S = 2.0
ENGINE_DEATH_EXIT_CODE = 1


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
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_queued_requests: int | None = None,
              max_logprobs: int = 20, return_tokens_as_token_ids: bool = False,
              enable_tokenizer_info_endpoint: bool = False, enable_prompt_tokens_details: bool = False,
              tool_settings: ToolSettings | None = None) -> FastAPI:
    """`tool_settings`: --enable-auto-tool-choice and --tool-call-parser (serving_tools.py)."""
    served_model_name = served_model_name or engine.model_name
    app = FastAPI(title="Kestrel OpenAI-compatible server", version=kestrel.__version__)
    metrics = ServerMetrics(engine, served_model_name)
    # One thread: a Hugging Face fast tokenizer must not be entered by two threads at once (as vLLM's
    # tokenizer executor); the event loop stays free while it works.
    tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kestrel-tokenizer")
    serving = {"completion": OpenAIServingCompletion(engine, served_model_name, metrics, tokenizer_pool),
               "chat": OpenAIServingChat(engine, served_model_name, metrics, tokenizer_pool),
               "tokenization": OpenAIServingTokenization(engine, served_model_name, metrics, tokenizer_pool)}
    if tool_settings is not None:
        serving["chat"].tool_settings = tool_settings
        for endpoint in serving.values():
            endpoint.tool_format = tool_settings.parser or endpoint.tool_format
    for s in serving.values():
        s.max_logprobs, s.return_tokens_as_token_ids = max_logprobs, return_tokens_as_token_ids
        s.enable_prompt_tokens_details = enable_prompt_tokens_details
    queue_limit = QueueLimit(engine, max_queued_requests)
    load = {"server_load": 0}  # generation requests being served, streams until their last byte (/load)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    app.include_router(dashboard_router(engine, metrics))

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

    def check_running() -> None:
        if not engine.is_running:
            raise APIError(str(engine.not_running_error()), 503)

    async def run(handler, req):
        """Admit the request (or answer 429), run its handler, map engine errors to HTTP."""
        check_running()
        admission = queue_limit.admit()
        try:
            return await handler(req, admission)
        except ValueError as e:  # raised by the engine before it yields anything
            raise APIError(str(e), 400) from None
        except Exception as e:
            error = engine_error(e)
            if error is None:
                raise
            raise error from None
        finally:
            admission.release()

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses={200: json_or_event_stream(CompletionResponse, CompletionChunk),
                         **error_responses(*GENERATION_ERRORS)})
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await read_json(request, max_body_bytes))
        return await counted(request, serving["completion"].completions, req)

    async def counted(request: Request, handler, req) -> Response:
        """Run a generation handler, counted in /load's server_load until its response is sent."""
        load["server_load"] += 1
        try:
            result = await unless_disconnected(request, run(handler, req))
        except BaseException:
            load["server_load"] -= 1
            raise
        response = result if isinstance(result, Response) else JSONResponse(result)

        def done() -> None:
            load["server_load"] -= 1
        response.background = BackgroundTask(done)
        return response

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses={200: json_or_event_stream(ChatCompletionResponse, ChatCompletionChunk),
                         **error_responses(*GENERATION_ERRORS)})
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await read_json(request, max_body_bytes))
        return await counted(request, serving["chat"].chat, req)

    # Not in /openapi.json: its bodies and answers are those of the two routes it stands for.
    @app.post("/invocations", include_in_schema=False)
    async def invocations(request: Request):
        """vLLM's (SageMaker's) one route: a chat completion if the body has `messages`, else a
        completion if it has `prompt`."""
        body = await read_json(request, max_body_bytes)
        if isinstance(body, dict) and "messages" in body:
            return await counted(request, serving["chat"].chat, parse_body(ChatCompletionRequest, body))
        if isinstance(body, dict) and "prompt" in body:
            return await counted(request, serving["completion"].completions, parse_body(CompletionRequest, body))
        raise APIError("/invocations takes a chat completion request (with 'messages') or a completion request "
                       "(with 'prompt')", 400)

    @app.get("/load", responses={200: {"model": LoadResponse}})
    async def server_load():
        return {"server_load": load["server_load"]}

    @app.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401)})
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, root=engine.model_name,
                                         max_model_len=serving["completion"].max_model_len)]).model_dump()

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is running"}, **error_responses(503)})
    async def health():
        if engine.is_running:
            return Response(status_code=200)
        return error_response(str(engine.not_running_error()), 503)

    @app.get("/version", responses={200: {"model": VersionResponse}})
    async def version():
        return {"version": kestrel.__version__}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
              responses={200: {"model": TokenizeResponse}, **error_responses(400, 404, 413)})
    async def tokenize(request: Request):
        req = parse_body(TokenizeRequest, await read_json(request, max_body_bytes))
        return await serving["tokenization"].tokenize(req)

    @app.get("/tokenizer_info", responses={200: {"description": "The tokenizer's configuration"},
                                           **error_responses(404)})
    async def tokenizer_info():
        # As vLLM's: off unless asked for (it shows the chat template and special tokens).
        if not enable_tokenizer_info_endpoint:
            return error_response("/tokenizer_info is off; start the server with --enable-tokenizer-info-endpoint",
                                  404)
        return serving["tokenization"].tokenizer_info()

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **error_responses(400, 404, 413)})
    async def detokenize(request: Request):
        req = parse_body(DetokenizeRequest, await read_json(request, max_body_bytes))
        return await serving["tokenization"].detokenize(req)

    @app.get("/v1/requests/{request_id}/trace",
             responses={200: {"model": RequestTraceResponse}, **error_responses(401, 404)})
    async def request_trace(request_id: str):
        # The OpenAI response id (chatcmpl-..., cmpl-...): a completion with several prompts has a
        # trace per prompt.
        if engine.traces is None:
            return error_response("request traces are off; start the server with --request-trace-buffer N to "
                                  "keep the last N requests' traces", 404)
        traces = engine.traces.find(request_id)
        if not traces:
            return error_response(f"no trace of request {request_id!r}: the server keeps the traces of the last "
                                  f"{engine.traces.capacity} requests", 404)
        return {"id": request_id, "object": "request.trace", "requests": [t.to_dict() for t in traces]}

    @app.post("/start_profile", response_class=Response,
              responses={200: {"description": "The profiler started"}, **error_responses(404)})
    async def start_profile():
        return _profile(True)

    @app.post("/stop_profile", response_class=Response,
              responses={200: {"description": "The profiler stopped; its trace is in --torch-profiler-dir"},
                         **error_responses(404)})
    async def stop_profile():
        return _profile(False)

    def _profile(start: bool):
        # As vLLM's: only when the server was started with a folder for the traces.
        if engine.config.torch_profiler_dir is None:
            return error_response("profiling is off; start the server with --torch-profiler-dir DIR", 404)
        engine.profile(start)
        return Response(status_code=200)

    @app.post("/reset_prefix_cache", response_class=Response,
              responses={200: {"description": "The prefix cache is empty"}})
    async def reset_prefix_cache():
        # As vLLM's: so that repeated benchmark runs do not hit the blocks of the run before.
        engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus metrics, in its text format"}})
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    add_models(app, requests=[CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest],
               chunks=[CompletionChunk, ChatCompletionChunk])
    return app


def run_server(args) -> int:
    """`kestrel serve`: start the engine core, then serve HTTP until SIGINT/SIGTERM (exit code 0) or
    until the engine core fails (exit code 1)."""
    from kestrel.engine.arg_utils import EngineArgs, engine_kwargs
    from kestrel.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(args)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if kwargs.get("model") not in (None, tag):
            raise ValueError(f"two models given: {tag!r} and --model {kwargs['model']!r}")
        kwargs["model"] = tag
    api_key = args.api_key if args.api_key is not None else envs.KESTREL_API_KEY
    tool_settings = ToolSettings(getattr(args, "enable_auto_tool_choice", False),
                                 getattr(args, "tool_call_parser", None))
    leave_cores_to_the_engine()
    engine = AsyncLLM.from_engine_args(EngineArgs(**kwargs))
    try:
        app = build_app(engine, args.served_model_name or engine.model_name, api_key=api_key,
                        max_body_bytes=args.max_body_bytes, max_queued_requests=args.max_queued_requests,
                        max_logprobs=getattr(args, "max_logprobs", 20),
                        return_tokens_as_token_ids=getattr(args, "return_tokens_as_token_ids", False),
                        enable_tokenizer_info_endpoint=getattr(args, "enable_tokenizer_info_endpoint", False),
                        enable_prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
                        tool_settings=tool_settings)
        # uvloop and httptools, not asyncio and h11: ~0.25 ms less CPU per streamed token, which on a
        # small machine is taken from the model's cores (BENCHMARKS.md, Zen 4).
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                loop="uvloop", http="httptools", timeout_graceful_shutdown=5)
        server = _Server(config, engine)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal; end with exit code 0
        # through `finally` (which stops the engine core) instead of dying by the default handler.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGINT, _exit_on_signal)
        freeze_startup_heap()
        return_freed_memory()  # what reading the model's config and tokenizer left (~30 MB)
        print(f"kestrel: serving {args.served_model_name or engine.model_name} on http://{args.host}:{args.port}",
              flush=True)
        server.run()
    finally:
        engine.shutdown()
    if engine.error is not None:
        print(f"kestrel: exiting with code {ENGINE_DEATH_EXIT_CODE}: {engine.error}", flush=True)
        return ENGINE_DEATH_EXIT_CODE
    return 0


def leave_cores_to_the_engine() -> None:
    """The API server computes little (HTTP, tokenizing, detokenizing): one torch thread, and no
    tokenizers thread pool (inherited by the engine core, whose tokenizer is for structured outputs),
    so that neither fights the worker's pool for its cores."""
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Server(uvicorn.Server):
    """uvicorn, with two exits of its own:
    - on SIGINT/SIGTERM uvicorn waits (up to timeout_graceful_shutdown) for open connections; end
      every in-flight request at once instead, each with one final error response (streams: an
      error event, then [DONE]), so shutdown is prompt and no request is lost silently;
    - when the engine core fails or dies, stop serving (run_server then exits non-zero)."""

    def __init__(self, config, engine) -> None:
        super().__init__(config)
        self.engine = engine

    async def serve(self, sockets=None) -> None:
        watchdog = asyncio.create_task(self._exit_when_engine_fails())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _exit_when_engine_fails(self) -> None:
        error = await self.engine.wait_until_errored()
        logger.error("%s; the server exits in %.0f s so that a supervisor can restart it", error,
                     ENGINE_DEATH_EXIT_DELAY_S)
        await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY_S)
        self.should_exit = True

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
