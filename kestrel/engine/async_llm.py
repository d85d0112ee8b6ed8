"""The asynchronous front end used by the API server: input processing and output processing in
this process, the engine core in its own process (kestrel/core/core_process.py), ZeroMQ between.

One asyncio task drains the engine core's outputs, turns them into text (OutputProcessor) and wakes
the per-request streams. A request whose consumer goes away (client disconnect) is aborted in the
engine core, so its KV blocks return to the pool.

If a step fails, the engine core sends an `EngineCoreFailure` (the exception's message, and every
request it held ended with `FinishReason.ERROR`) and exits; if its process dies, the output task sees
it within `DEATH_POLL_S`. Either way every open stream ends at once with `EngineDeadError`,
`is_running` turns False, and `wait_until_errored()` returns, so that the server can exit.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
import zmq
import zmq.asyncio

from kestrel.config import EngineArgs, EngineConfig
from kestrel.core import core_process
from kestrel.engine.arg_utils import create_engine_config
from kestrel.engine.exceptions import EngineDeadError, EngineStoppedError
from kestrel.engine.output_processor import OutputProcessor
from kestrel.engine.processor import Processor, PromptType
from kestrel.engine.stat_logger import LoggingStatLogger
from kestrel.messages import EngineCoreFailure, SchedulerStats
from kestrel.model.loader import ModelSource
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
DEATH_POLL_S = 0.5

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStoppedError"]


class AsyncLLM:
    def __init__(self, config: EngineConfig, source: ModelSource, tokenizer) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.model_name = source.name
        self.processor = Processor(config.model, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        self.last_scheduler_stats: SchedulerStats | None = None
        self.stat_logger = LoggingStatLogger.from_config(config)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0,
                         "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self._streams: dict[str, asyncio.Queue] = {}
        self.num_waiting_requests = 0  # accepted, no output yet (queued or in prefill)
        self._error: EngineDeadError | None = None  # set once the engine core has failed or died
        self._stopped = False                      # stop_requests() was called: the server is shutting down
        self._errored_event: asyncio.Event | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._start_engine_core()
        self._output_task: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        config, source, tokenizer = create_engine_config(args)
        return cls(config, source, tokenizer)

    # ---- the engine-core process -------------------------------------------------------------

    def _start_engine_core(self) -> None:
        sock_dir = tempfile.mkdtemp(prefix="kestrel-")
        self._input_addr = f"ipc://{sock_dir}/input"
        self._output_addr = f"ipc://{sock_dir}/output"
        # Plain sockets, so the engine can be built outside an event loop; the output socket gets
        # an asyncio view once a loop drains it.
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(self._input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(self._output_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=core_process.run_engine_core, name="kestrel-engine-core",
            args=(self.config, self.source, self._input_addr, self._output_addr), daemon=True)
        self.process.start()
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if poller.poll(timeout=500):
                kind, payload = self._output.recv_multipart()
                if kind == core_process.READY:
                    return
                if kind == core_process.FAILED:
                    self.process.join(timeout=5)
                    raise ValueError(msgspec.msgpack.decode(payload))
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core exited during start-up (exit code {self.process.exitcode})")
        self.shutdown()
        raise RuntimeError(f"the engine core did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def _ensure_output_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._output_task is None or self._output_task.get_loop() is not loop:
            self._errored_event = asyncio.Event()
            if self._error is not None:
                self._errored_event.set()
            self._output_task = loop.create_task(self._drain_outputs(zmq.asyncio.Socket.from_socket(self._output)))

    async def _drain_outputs(self, output: zmq.asyncio.Socket) -> None:
        while self._error is None:
            if not await output.poll(timeout=int(DEATH_POLL_S * 1000)):
                if not self.process.is_alive():
                    self._set_errored(EngineDeadError(f"the engine core died (exit code {self.process.exitcode})"))
                continue
            kind, payload = await output.recv_multipart()
            if kind == core_process.DEAD:
                self._on_failure(core_process.decode_failure(payload))
                continue
            if kind != core_process.OUTPUTS:
                continue
            outputs = core_process.decode_outputs(payload)
            if outputs.scheduler_stats is not None:
                self._record_stats(outputs.scheduler_stats)
            processed = self.output_processor.process_outputs(outputs.outputs)
            if processed.reqs_to_abort:
                self._send(core_process.ABORT, processed.reqs_to_abort)
            for out in processed.request_outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)

    def _record_stats(self, stats: SchedulerStats) -> None:
        self.last_scheduler_stats = stats
        self.stat_logger.record(stats)
        c = self.counters
        c["prompt_tokens"] += stats.num_prompt_tokens
        c["generation_tokens"] += stats.num_generation_tokens
        c["preemptions"] += stats.num_preemptions
        c["prefix_cache_queries"] += stats.prefix_cache_queries
        c["prefix_cache_hits"] += stats.prefix_cache_hits

    def _on_failure(self, failure: EngineCoreFailure) -> None:
        # Each request's state ends as the engine core ended it (FinishReason.ERROR); their streams
        # get the error itself, not a normal-looking last output.
        self.output_processor.process_outputs(failure.outputs)
        logger.error("the engine core failed: %s (%d requests ended with it)", failure.message, len(failure.outputs))
        self._set_errored(EngineDeadError(f"the engine core failed: {failure.message}"))

    def _set_errored(self, error: EngineDeadError) -> None:
        self._error = error
        self._fail_all(error)
        if self._errored_event is not None:
            self._errored_event.set()

    def _fail_all(self, error: Exception) -> None:
        for stream in self._streams.values():
            stream.put_nowait(type(error)(*error.args))  # one instance per stream: each gets its own traceback

    def stop_requests(self, reason: str) -> None:
        """Refuse new requests and end every open stream with `EngineStoppedError(reason)` (shutdown)."""
        self._stopped = True
        self._fail_all(EngineStoppedError(reason))

    async def wait_until_errored(self) -> EngineDeadError:
        """Return (the error) once the engine core has failed or died; never returns while it serves."""
        self._ensure_output_task()
        assert self._errored_event is not None
        await self._errored_event.wait()
        assert self._error is not None
        return self._error

    def _send(self, kind: bytes, payload) -> None:
        self._input.send_multipart([kind, self._encoder.encode(payload)], copy=False)

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._error is None and self.process.is_alive()

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine core stopped serving (a failed step, or its process died); None while it serves."""
        return self._error

    def not_running_error(self) -> Exception:
        """The error for a request that arrives when the engine no longer serves."""
        if self._error is not None:
            return EngineDeadError(f"the engine core is not running: {self._error}")
        if self._stopped:
            return EngineStoppedError("the engine is shutting down")
        return EngineDeadError(f"the engine core is not running (exit code {self.process.exitcode})")

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress: with `stream`, only what is new each time (text, token ids
        and logprobs deltas; finish_reason on a completion's last delta; `prompt_logprobs`, complete,
        on the first output only, and nothing is yielded before they are complete); else one final
        output."""
        if not self.is_running:
            raise self.not_running_error()
        self._ensure_output_task()
        request_id = request_id or uuid.uuid4().hex
        arrival = time.time()
        text, ids, core_requests = self.processor.process(request_id, prompt, params, arrival)
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(request_id, text, ids, params,
                                          [r.request_id for r in core_requests], arrival)
        self._streams[request_id] = queue
        sent = [_Sent() for _ in core_requests]
        prompt_logprobs_sent = False
        finished = waiting = False
        try:
            for request in core_requests:
                self._send(core_process.ADD, request)
            self.num_waiting_requests += 1
            waiting = True
            while not finished:
                latest, error = await _next_output(queue)
                if waiting:
                    self.num_waiting_requests -= 1
                    waiting = False
                if latest is not None:
                    finished = latest.finished
                    if stream:
                        held = False
                        if params.prompt_logprobs is not None:
                            if prompt_logprobs_sent:
                                latest = replace(latest, prompt_logprobs=None)
                            elif latest.prompt_logprobs is None and not finished:
                                held = True  # another sample ran ahead of the prompt's scoring: hold it
                            else:
                                prompt_logprobs_sent = True
                        if not held:
                            yield _delta(latest, sent)
                    elif finished:
                        yield latest
                if error is not None and not finished:
                    raise error
        finally:
            if waiting:
                self.num_waiting_requests -= 1
            self._streams.pop(request_id, None)
            if not finished and self.is_running:
                self._abort(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        children = self.output_processor.abort_requests([request_id])
        if children:
            self._send(core_process.ABORT, children)

    def shutdown(self) -> None:
        if self.process.is_alive():
            try:
                self._send(core_process.SHUTDOWN, None)
            except zmq.ZMQError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        task, self._output_task = self._output_task, None
        if task is not None and not task.get_loop().is_closed():
            task.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        for addr in (self._input_addr, self._output_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except OSError:
                pass


async def _next_output(queue: asyncio.Queue) -> tuple[RequestOutput | None, Exception | None]:
    """What piled up in a request's queue while its consumer was away: the latest output (they are
    cumulative, so it holds the others) and the error that ended the request, if one came."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    outputs = [item for item in items if not isinstance(item, Exception)]
    error = next((item for item in items if isinstance(item, Exception)), None)
    return (outputs[-1] if outputs else None), error


class _Sent:
    """How much of one completion a stream has handed out."""
    __slots__ = ("text", "tokens", "logprobs", "done")

    def __init__(self) -> None:
        self.text = self.tokens = self.logprobs = 0
        self.done = False


def _delta(out: RequestOutput, sent: list[_Sent]) -> RequestOutput:
    deltas: list[CompletionOutput] = []
    for c, s in zip(out.outputs, sent):
        if s.done:
            continue
        d = CompletionOutput(c.index, c.text[s.text:], c.token_ids[s.tokens:], c.cumulative_logprob,
                             c.logprobs[s.logprobs:] if c.logprobs is not None else None,
                             c.finish_reason, c.stop_reason)
        s.text, s.tokens = len(c.text), len(c.token_ids)
        s.logprobs = len(c.logprobs) if c.logprobs is not None else 0
        s.done = c.finished
        if d.text or d.token_ids or d.finished:
            deltas.append(d)
    return replace(out, outputs=deltas)
