"""The engine core in its own process: a busy loop around `EngineCore`, fed and drained over ZeroMQ.

    front end ──PUSH──► [input thread] ─queue─► busy loop (schedule → execute → update)
    front end ◄─PULL──────────────────────────────┘

The input socket is read on its own thread so that the loop can wait for work without blocking on
it. Outputs are sent from the loop itself: a send only hands the frames to ZeroMQ's I/O thread (the
socket has no high-water mark, so it never blocks), where an output thread of our own would cost a
thread wake-up and a GIL hand-over per step, taken from the cores the model computes on. Frames are
`[kind, msgspec-msgpack payload]`; the kinds are below. Only token ids cross.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq

from kestrel import envs
from kestrel.config import EngineConfig
from kestrel.core.engine_core import EngineCore
from kestrel.distributed.cpu_binding import bind_engine_core
from kestrel.distributed.lifecycle import exit_with_parent, freeze_startup_heap, inherit_program_logging
from kestrel.messages import EngineCoreFailure, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from kestrel.model.loader import ModelSource
from kestrel.worker.select_executor import executor_class

logger = logging.getLogger(__name__)

# Frame kinds, front end → engine core.
ADD = b"A"
ABORT = b"X"
SHUTDOWN = b"S"
RESET_PREFIX_CACHE = b"P"  # drop the cached prefix blocks (between benchmark runs); ignored while busy
PROFILE = b"T"         # payload True (start) or False (stop): the torch profiler in every worker
WORKER_FAILED = b"W"   # put on the input queue by the executor's failure callback, never sent
# Frame kinds, engine core → front end.
READY = b"R"
OUTPUTS = b"O"
FAILED = b"F"    # start-up failed; payload is the error message
DEAD = b"D"      # a step failed; payload is an EngineCoreFailure, and the process exits


# Test hooks (kestrel.envs), read once when the engine core starts; users never set them.
FAULT_AT_STEP_ENV = "KESTREL_TEST_FAULT_AT_STEP"  # N: the N-th step (from 1) raises, as a failing model would
HOLD_FILE_ENV = "KESTREL_TEST_HOLD_FILE"          # a path: no step runs while that file exists
HOLD_POLL_S = 0.01
OUTPUT_LINGER_MS = 2000


class InjectedFault(RuntimeError):
    """The step fault that KESTREL_TEST_FAULT_AT_STEP asks for."""


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_addr: str, output_addr: str) -> None:
        self.core = core
        self.inputs: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.encoder = msgspec.msgpack.Encoder()
        self.num_steps = 0
        self.fault_at_step = envs.KESTREL_TEST_FAULT_AT_STEP
        self.hold_file = envs.KESTREL_TEST_HOLD_FILE
        # A worker that dies while the loop waits for input must still stop the engine core.
        core.executor.register_failure_callback(lambda error: self.inputs.put((WORKER_FAILED, str(error).encode())))
        threading.Thread(target=self._read_inputs, args=(input_addr,), daemon=True).start()
        self.output = output_socket(output_addr)

    def _read_inputs(self, addr: str) -> None:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(addr)
        while True:
            kind, payload = sock.recv_multipart()
            self.inputs.put((kind, payload))

    def send(self, kind: bytes, payload: Any) -> None:
        self.output.send_multipart((kind, self.encoder.encode(payload)))

    def run_busy_loop(self) -> None:
        """Step until told to shut down. If a step (or an input) raises, tell the front end which
        requests it ended and why, then exit non-zero: the core's state is no longer trusted."""
        self.send(READY, {"num_kv_blocks": self.core.num_kv_blocks})
        freeze_startup_heap()  # while the front end finishes its own start-up
        try:
            self._loop()
        except Exception as exc:  # noqa: BLE001 - reported to the front end, then the process exits
            logger.exception("engine core: a step failed; stopping")
            self._report_failure(exc)
            self._stop(shutdown_core=False)
            sys.exit(1)
        self._stop()

    def _loop(self) -> None:
        stats_sent = False  # the front end has the scheduler's state as it is now
        while True:
            stepping = self.core.has_unfinished_requests() and not self._held()
            if not stepping:
                # Going idle (last request finished or aborted) or held: report the state once, so
                # the front end's gauges do not keep the last busy step's numbers.
                if not stats_sent:
                    self.send(OUTPUTS, EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats(),
                                                         timestamp=time.monotonic()))
                    stats_sent = True
                item = self._wait_for_input()
                if item is not None:
                    if not self._handle(*item):
                        return
                    stats_sent = False
            while not self.inputs.empty():
                if not self._handle(*self.inputs.get_nowait()):
                    return
                stats_sent = False
            if stepping:
                outputs = self._step()
                if outputs is not None:
                    self.send(OUTPUTS, outputs)
                    stats_sent = False

    def _wait_for_input(self) -> tuple[bytes, bytes] | None:
        """The next input; blocks until one arrives, or, while held with requests to run, only for a
        short poll (None if nothing came)."""
        if self.hold_file is None or not self.core.has_unfinished_requests():
            return self.inputs.get()
        try:
            return self.inputs.get(timeout=HOLD_POLL_S)
        except queue.Empty:
            return None

    def _held(self) -> bool:
        return self.hold_file is not None and os.path.exists(self.hold_file)

    def _step(self) -> EngineCoreOutputs | None:
        self.num_steps += 1
        if self.num_steps == self.fault_at_step:
            # The wall-clock time lets a test measure how soon the failure reached each client.
            raise InjectedFault(f"injected fault at step {self.num_steps} ({FAULT_AT_STEP_ENV}) "
                                f"at t={time.time():.3f}")
        return self.core.step()

    def _handle(self, kind: bytes, payload: bytes) -> bool:
        """Apply one input; False on shutdown."""
        if kind == ADD:
            self.core.add_request(self.request_decoder.decode(payload))
        elif kind == ABORT:
            self.core.abort_requests(self.ids_decoder.decode(payload))
        elif kind == RESET_PREFIX_CACHE:
            self.core.reset_prefix_cache()
        elif kind == PROFILE:
            self.core.profile(msgspec.msgpack.decode(payload, type=bool))
        elif kind == SHUTDOWN:
            return False
        elif kind == WORKER_FAILED:
            raise RuntimeError(payload.decode())
        return True

    def _report_failure(self, exc: Exception) -> None:
        # Read-only: after a failed step the scheduler's bookkeeping may be half done.
        ended = [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR)
                 for request_id in list(self.core.scheduler.requests)]
        self.send(DEAD, EngineCoreFailure(f"{type(exc).__name__}: {exc}", ended, time.monotonic()))

    def _stop(self, shutdown_core: bool = True) -> None:
        self.output.close()  # its linger still delivers what was sent
        if shutdown_core:
            self.core.shutdown()


def output_socket(addr: str) -> zmq.Socket:
    """The PUSH socket to the front end: sends never block (no high-water mark: what the front end has
    not read yet waits in ZeroMQ's queue, as it waited in a Python queue before), and messages sent
    before a close are still delivered for up to OUTPUT_LINGER_MS."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
    sock.connect(addr)
    return sock


def run_engine_core(settings: Connection) -> None:
    """Entry point of the engine-core process. The front end starts it before it has read the model's
    config and tokenizer, so that this process's imports (torch and the engine, ~3 s on two cores) run
    meanwhile; it then waits for `(config, source, input_addr, output_addr)` on `settings`, and ends
    quietly if the front end closes that pipe instead (a bad model or flag)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    exit_with_parent()
    try:
        config, source, input_addr, output_addr = settings.recv()
    except EOFError:
        return
    finally:
        settings.close()
    serve_engine_core(config, source, input_addr, output_addr)


def serve_engine_core(config: EngineConfig, source: ModelSource, input_addr: str, output_addr: str) -> None:
    """Build the engine core (its workers load the model), say READY or FAILED, then run the busy loop."""
    inherit_program_logging()
    try:
        bind_engine_core(config.parallel)
        if config.parallel.distributed_executor_backend != "uni":
            torch.set_num_threads(1)  # the workers compute in their own processes; this one only plans
        core = EngineCore(config, executor_class(config.parallel)(config, source))
    except Exception as exc:
        sock = output_socket(output_addr)
        sock.send_multipart([FAILED, msgspec.msgpack.encode(f"{type(exc).__name__}: {exc}")])
        sock.close()
        raise
    EngineCoreProc(core, input_addr, output_addr).run_busy_loop()


_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
_FAILURE_DECODER = msgspec.msgpack.Decoder(EngineCoreFailure)


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    return _OUTPUTS_DECODER.decode(payload)


def decode_failure(payload: bytes) -> EngineCoreFailure:
    return _FAILURE_DECODER.decode(payload)
