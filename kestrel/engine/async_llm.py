"""The asynchronous front end used by the API server: input processing and output processing in
this process, the engine cores in their own processes (kestrel/core/core_process.py), ZeroMQ between.

With `data_parallel_size` D there are D engine cores, each with its own scheduler, KV cache and
workers (core_client.py); each request goes to the least-loaded one, which owns it until it ends
(router.py). One asyncio task per core drains its outputs, turns them into text (OutputProcessor)
and wakes the per-request streams. A request whose consumer goes away (client disconnect) is
aborted in the engine core that owns it, so its KV blocks return to that core's pool.

If a step fails, that engine core sends an `EngineCoreFailure` (the exception's message, and every
request it held ended with `FinishReason.ERROR`) and exits; if a core's process dies, its output task
sees it at once (the event loop watches the process's sentinel, no polling). Either way, as vLLM
treats any core's death, the whole engine is dead: every open stream ends at once with
`EngineDeadError`, `is_running` turns False, and `wait_until_errored()` returns, so that the server
can exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import zmq

from kestrel.config import EngineConfig
from kestrel.core import core_process
from kestrel.engine.arg_utils import EngineArgs, create_engine_config, settings_without_model
from kestrel.engine.core_client import (
    EngineCoreProcess,
    EngineCoreProcesses,
    merge_gauges,
    prestart_engine_cores,
    stop_engine_cores,
)
from kestrel.engine.exceptions import EngineDeadError, EngineStoppedError
from kestrel.engine.output_processor import OutputProcessor
from kestrel.engine.processor import Processor, PromptType
from kestrel.engine.stat_logger import IterationTokens, LoggingStatLogger
from kestrel.engine.tracing import API_SERVER, RequestTrace, TraceStore
from kestrel.messages import EngineCoreFailure, EngineCoreOutputs, SchedulerStats, SpecDecodingStats
from kestrel.model.loader import ModelSource
from kestrel.outputs import CompletionOutput, RequestOutput
from kestrel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStoppedError"]

COUNTER_KEYS = ("prompt_tokens", "generation_tokens", "preemptions", "prefix_cache_queries", "prefix_cache_hits",
                # engine steps: how many, the requests and tokens in them, and where their time went (s)
                "steps", "step_requests", "step_tokens", "busy_s", "schedule_s", "prepare_s", "forward_s",
                "sample_s")


class AsyncLLM:
    def __init__(self, config: EngineConfig, source: ModelSource, tokenizer,
                 prestarted: list[EngineCoreProcess] | None = None) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.model_name = source.name
        self.processor = Processor(config.model, tokenizer)
        self.output_processor = OutputProcessor(tokenizer)
        size = config.parallel.data_parallel_size
        # Per engine core, as it last reported, and its cumulative counters (COUNTER_KEYS).
        self.core_stats: list[SchedulerStats | None] = [None] * size
        self.core_counters: list[dict[str, float]] = [dict.fromkeys(COUNTER_KEYS, 0) for _ in range(size)]
        self.core_spec_decoding: list[SpecDecodingStats] = [SpecDecodingStats() for _ in range(size)]
        self.iteration_tokens = IterationTokens()  # tokens per engine step, over all cores
        # One stats line per engine core, as vLLM logs them ("Engine 0: ..." when there are several).
        self.stat_loggers = [LoggingStatLogger.from_config(config, f"Engine {i}" if size > 1 else None)
                             for i in range(size)]
        self._streams: dict[str, asyncio.Queue] = {}
        self.num_waiting_requests = 0  # accepted, no output yet (queued or in prefill)
        self._error: EngineDeadError | None = None  # set once an engine core has failed or died
        self._stopped = False                      # stop_requests() was called: the server is shutting down
        self._errored_event: asyncio.Event | None = None
        self._output_tasks: list[asyncio.Task] = []
        self.engine_cores = EngineCoreProcesses(config, source, prestarted)
        # The last N requests' traces (--request-trace-buffer N); None when request traces are off.
        self.traces = TraceStore(config.request_trace_buffer) if config.request_trace_buffer else None
        self.span_exporter = None  # --otlp-traces-endpoint: each finished request's trace as spans
        if config.otlp_traces_endpoint:
            from kestrel.engine.otel import SpanExporter, otlp_span_processor
            self.span_exporter = SpanExporter(otlp_span_processor(config.otlp_traces_endpoint), self.model_name)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        # The engine-core processes start once the flags are checked: their imports then run while
        # this process reads the model's config and tokenizer (a server starts ~3 s sooner on two cores).
        cores = prestart_engine_cores(settings_without_model(args)[1].data_parallel_size)
        try:
            config, source, tokenizer = create_engine_config(args)
            return cls(config, source, tokenizer, cores)
        except BaseException:
            stop_engine_cores(cores)
            raise

    # ---- the engine-core processes -----------------------------------------------------------

    @property
    def process(self):
        """Engine core 0's process (the only one unless data parallel)."""
        return self.engine_cores.cores[0].process

    @property
    def processes(self) -> list:
        return [core.process for core in self.engine_cores.cores]

    @property
    def last_scheduler_stats(self) -> SchedulerStats | None:
        """The engine cores' latest states together (requests summed, KV-cache usage averaged)."""
        return merge_gauges(self.core_stats)

    @property
    def counters(self) -> dict[str, float]:
        """Every engine core's counters summed."""
        return {key: sum(c[key] for c in self.core_counters) for key in COUNTER_KEYS}

    @property
    def core_num_kv_blocks(self) -> list[int]:
        """Each engine core's KV-cache pool, in blocks."""
        return [core.num_kv_blocks for core in self.engine_cores.cores]

    @property
    def num_open_requests(self) -> int:
        """Requests accepted whose final output has not been taken yet."""
        return len(self._streams)

    def profile(self, start: bool) -> None:
        """Start or stop the torch profiler in every engine core's workers (--torch-profiler-dir)."""
        for core in self.engine_cores.cores:
            core.send(core_process.PROFILE, start)

    def reset_prefix_cache(self) -> None:
        """Every engine core drops its cached prefix blocks before its next step (blocks in use stay)."""
        for core in self.engine_cores.cores:
            core.send(core_process.RESET_PREFIX_CACHE, None)

    def _ensure_output_task(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._output_tasks or self._output_tasks[0].get_loop() is not loop:
            self._errored_event = asyncio.Event()
            if self._error is not None:
                self._errored_event.set()
            self._output_tasks = [
                loop.create_task(self._drain_outputs(index, core))
                for index, core in enumerate(self.engine_cores.cores)]

    async def _drain_outputs(self, index: int, core: EngineCoreProcess) -> None:
        reader = _OutputReader(core.output, _exit_of(core))
        try:
            while self._error is None:
                message = await reader.next_message()
                if message is None:
                    self._set_errored(EngineDeadError(f"{core.label} died (exit code {core.exitcode})"))
                    return
                self._on_message(index, core, *message)
        finally:
            reader.close()

    def _on_message(self, index: int, core: EngineCoreProcess, kind: bytes, payload: bytes) -> None:
        if kind == core_process.DEAD:
            self._on_failure(core, core_process.decode_failure(payload))
        elif kind == core_process.OUTPUTS:
            self._on_outputs(index, core_process.decode_outputs(payload))

    def _on_outputs(self, index: int, outputs: EngineCoreOutputs) -> None:
        self.engine_cores.record_outputs(index, outputs)
        if outputs.scheduler_stats is not None:
            self._record_stats(index, outputs.scheduler_stats)
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_cores.abort_requests(processed.reqs_to_abort)
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _record_stats(self, index: int, stats: SchedulerStats) -> None:
        self.core_stats[index] = stats
        self.iteration_tokens.record(stats)
        self.stat_loggers[index].record(stats)
        c = self.core_counters[index]
        c["prompt_tokens"] += stats.num_prompt_tokens
        c["generation_tokens"] += stats.num_generation_tokens
        c["preemptions"] += stats.num_preemptions
        c["prefix_cache_queries"] += stats.prefix_cache_queries
        c["prefix_cache_hits"] += stats.prefix_cache_hits
        if stats.spec_decoding is not None:
            self.core_spec_decoding[index].add(stats.spec_decoding)
        step = stats.step
        if step is not None:
            c["steps"] += 1
            c["step_requests"] += step.num_reqs
            c["step_tokens"] += step.num_tokens
            c["busy_s"] += step.total_s
            c["schedule_s"] += step.schedule_s
            c["prepare_s"] += step.prepare_s
            c["forward_s"] += step.forward_s
            c["sample_s"] += step.sample_s

    def _on_failure(self, core: EngineCoreProcess, failure: EngineCoreFailure) -> None:
        # Each request's state ends as the engine core ended it (FinishReason.ERROR); their streams
        # get the error itself, not a normal-looking last output.
        self.output_processor.process_outputs(failure.outputs)
        logger.error("%s failed: %s (%d requests ended with it)", core.label, failure.message, len(failure.outputs))
        self._set_errored(EngineDeadError(f"{core.label} failed: {failure.message}"))

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
        """Return (the error) once an engine core has failed or died; never returns while they serve."""
        self._ensure_output_task()
        assert self._errored_event is not None
        await self._errored_event.wait()
        assert self._error is not None
        return self._error

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._error is None and self.engine_cores.dead_core() is None

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine stopped serving (a core's failed step, or a core's process died); None while it serves."""
        return self._error

    def not_running_error(self) -> Exception:
        """The error for a request that arrives when the engine no longer serves."""
        if self._error is not None:
            return EngineDeadError(f"the engine core is not running: {self._error}")
        if self._stopped:
            return EngineStoppedError("the engine is shutting down")
        dead = self.engine_cores.dead_core() or self.engine_cores.cores[0]
        return EngineDeadError(f"{dead.label} is not running (exit code {dead.exitcode})")

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       stream: bool = True, timeline: list[tuple[str, float]] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress: with `stream`, only what is new each time (text, token ids
        and logprobs deltas; finish_reason on a completion's last delta; `prompt_logprobs`, complete,
        on the first output only, and nothing is yielded before they are complete); else one final
        output. `timeline`: the caller's events for the request's trace so far ((name, monotonic time):
        received, tokenized), when request traces are on."""
        if not self.is_running:
            raise self.not_running_error()
        if stream and isinstance(params, SamplingParams) and params.num_samples > params.n:
            raise ValueError(f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best samples "
                             "are known only at the end")
        self._ensure_output_task()
        request_id = request_id or uuid.uuid4().hex
        arrival = time.time()
        trace = self._start_trace(request_id, timeline)
        text, ids, core_requests = self.processor.process(request_id, prompt, params, arrival)
        queue: asyncio.Queue = asyncio.Queue()
        state = self.output_processor.add_request(request_id, text, ids, params,
                                                  [r.request_id for r in core_requests], arrival, trace)
        self._streams[request_id] = queue
        sent = [_Sent() for _ in core_requests]
        prompt_logprobs_sent = False
        finished = waiting = False
        try:
            # Timed before the send: the engine core can schedule and step the request before
            # add_requests returns, and the trace orders events by their times.
            sent_at = time.monotonic()
            state.engine_index = self.engine_cores.add_requests(core_requests)
            if trace is not None:
                trace.add(API_SERVER, "sent", at=sent_at, engine=state.engine_index)
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
            if trace is not None and self.span_exporter is not None:
                self.span_exporter.export(trace, {"kestrel.finished": finished})

    def _start_trace(self, request_id: str, timeline: list[tuple[str, float]] | None) -> RequestTrace | None:
        if self.traces is None and self.span_exporter is None:
            return None
        trace = self.traces.start(request_id) if self.traces is not None else RequestTrace(request_id)
        for name, at in timeline or [("received", time.monotonic())]:
            trace.add(API_SERVER, name, at)
        return trace

    def trace_of(self, request_id: str) -> RequestTrace | None:
        """The kept trace of an engine request id (None when traces are off or it was dropped)."""
        return self.traces.get(request_id) if self.traces is not None else None

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        children = self.output_processor.abort_requests([request_id])
        if children:
            self.engine_cores.abort_requests(children)

    def shutdown(self) -> None:
        tasks, self._output_tasks = self._output_tasks, []
        for task in tasks:
            if not task.get_loop().is_closed():
                task.cancel()
        self.engine_cores.shutdown()
        if self.span_exporter is not None:
            self.span_exporter.shutdown()  # sends the spans still batched


# After an engine core's process exits, how long its last messages (its failure report) may take to
# come through the socket; they are handled before its death is. One killed by a signal sent nothing.
EXIT_DRAIN_MS = 100


def _exit_of(core: EngineCoreProcess) -> asyncio.Future:
    """A future that the event loop resolves as soon as the core's process ends (its sentinel turns
    readable), with how long to wait for its last messages (ms); cancel it to stop watching."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    sentinel = core.process.sentinel

    def on_exit() -> None:
        loop.remove_reader(sentinel)  # the sentinel stays readable: watch it once
        if not exited.done():
            exited.set_result(0 if (core.exitcode or 0) < 0 else EXIT_DRAIN_MS)

    loop.add_reader(sentinel, on_exit)
    exited.add_done_callback(lambda _: loop.remove_reader(sentinel))
    return exited


class _OutputReader:
    """An engine core's output socket read from the event loop: the socket's file descriptor wakes
    the reader, which then takes every queued message with non-blocking receives. (zmq.asyncio does
    the same through a future, a poller and several callbacks per message: on a streamed token that
    machinery cost the API server as much CPU as the rest of the token's path.)

    ZeroMQ's descriptor only says that the socket's state may have changed: after a wake-up the
    reader takes messages until the socket's events say that none is left, which re-arms it; a
    wake-up with nothing queued is harmless."""

    def __init__(self, socket: zmq.Socket, exited: asyncio.Future) -> None:
        self.socket = socket
        self.exited = exited
        self.loop = asyncio.get_running_loop()
        self.fd = socket.getsockopt(zmq.FD)
        self._wake: asyncio.Future | None = None
        self.loop.add_reader(self.fd, self._on_readable)
        exited.add_done_callback(lambda _: self._on_readable())

    def _on_readable(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _receive(self) -> list[bytes] | None:
        # Asking first is much cheaper than the zmq.Again that an empty receive raises.
        if not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return None
        try:
            return self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    async def next_message(self) -> list[bytes] | None:
        """The core's next message, or None once its process has ended (`exited`) and every message
        it sent has been read (waiting up to the exit's drain time for those still in transit)."""
        while not self.exited.done():
            message = self._receive()
            if message is not None:
                return message
            self._wake = self.loop.create_future()
            await self._wake
        deadline = self.loop.time() + self.exited.result() / 1000
        while (message := self._receive()) is None:
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                return None
            self._wake = self.loop.create_future()
            await asyncio.wait((self._wake,), timeout=remaining)
        return message

    def close(self) -> None:
        self.exited.cancel()
        self.loop.remove_reader(self.fd)
        if self._wake is not None and not self._wake.done():
            self._wake.cancel()


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
