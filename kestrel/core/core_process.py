"""The engine core in its own process: a busy loop around `EngineCore`, fed and drained over ZeroMQ.

    front end ──PUSH──► [input thread] ─queue─► busy loop (schedule → execute → update)
    front end ◄─PULL─── [output thread] ◄─queue─┘

Socket I/O lives on its own threads so the step loop never blocks on it. Frames are
`[kind, msgspec-msgpack payload]`; the kinds are below. Only token ids cross.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
from typing import Any

import msgspec
import zmq

from kestrel.config import EngineConfig
from kestrel.core.engine_core import EngineCore
from kestrel.messages import EngineCoreOutputs, EngineCoreRequest
from kestrel.model.loader import ModelSource
from kestrel.worker.executor import Executor

logger = logging.getLogger(__name__)

# Frame kinds, front end → engine core.
ADD = b"A"
ABORT = b"X"
SHUTDOWN = b"S"
# Frame kinds, engine core → front end.
READY = b"R"
OUTPUTS = b"O"
FAILED = b"F"    # start-up failed; payload is the error message


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_addr: str, output_addr: str) -> None:
        self.core = core
        self.inputs: queue.Queue[tuple[bytes, bytes]] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.encoder = msgspec.msgpack.Encoder()
        threading.Thread(target=self._read_inputs, args=(input_addr,), daemon=True).start()
        self.output_thread = threading.Thread(target=self._write_outputs, args=(output_addr,), daemon=True)
        self.output_thread.start()

    def _read_inputs(self, addr: str) -> None:
        sock = zmq.Context.instance().socket(zmq.PULL)
        sock.connect(addr)
        while True:
            kind, payload = sock.recv_multipart()
            self.inputs.put((kind, payload))

    def _write_outputs(self, addr: str) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(addr)
        while (item := self.outputs.get()) is not None:
            sock.send_multipart(item)
        sock.close()

    def send(self, kind: bytes, payload: Any) -> None:
        self.outputs.put((kind, self.encoder.encode(payload)))

    def run_busy_loop(self) -> None:
        self.send(READY, {"num_kv_blocks": self.core.num_kv_blocks})
        idle_reported = False
        while True:
            if not self.core.has_unfinished_requests():
                # Going idle (last request finished or aborted): report the empty state once, so
                # the front end's gauges do not keep the last busy step's numbers.
                if not idle_reported:
                    self.send(OUTPUTS, EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats(),
                                                         timestamp=time.monotonic()))
                    idle_reported = True
                if not self._handle(*self.inputs.get()):  # block until something arrives
                    break
            while not self.inputs.empty():
                if not self._handle(*self.inputs.get_nowait()):
                    return self._stop()
            if self.core.has_unfinished_requests():
                idle_reported = False
                outputs = self.core.step()
                self.send(OUTPUTS, outputs)
        self._stop()

    def _handle(self, kind: bytes, payload: bytes) -> bool:
        """Apply one input; False on shutdown."""
        if kind == ADD:
            self.core.add_request(self.request_decoder.decode(payload))
        elif kind == ABORT:
            self.core.abort_requests(self.ids_decoder.decode(payload))
        elif kind == SHUTDOWN:
            return False
        return True

    def _stop(self) -> None:
        self.outputs.put(None)
        self.output_thread.join(timeout=5)
        self.core.shutdown()


def exit_with_parent() -> None:
    """End this process when the front end that started it dies, even by SIGKILL: no orphans."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_engine_core(config: EngineConfig, source: ModelSource, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine-core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    exit_with_parent()
    try:
        core = EngineCore(config, Executor.get_class(config.parallel)(config, source))
    except Exception as exc:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(output_addr)
        sock.send_multipart([FAILED, msgspec.msgpack.encode(f"{type(exc).__name__}: {exc}")])
        sock.close()
        raise
    EngineCoreProc(core, input_addr, output_addr).run_busy_loop()


_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    return _OUTPUTS_DECODER.decode(payload)
