"""A process per rank (`--distributed-executor-backend mp`): the executor on one machine.

    engine core ──XPUB (one send per step)──► worker 0 .. worker N-1   (SUB, each runs every message)
    engine core ◄──PULL───────────────────── worker answers            (PUSH: the output rank's step
                                                                         result, every rank's RPC result,
                                                                         any rank's error)

A step's `SchedulerOutput` is encoded once and published once; ZeroMQ hands the same bytes to every
subscriber. Workers run messages in the order published, so a step, an RPC and the next step are seen
in the same order by every rank. Only the output rank answers a step (the others' halves meet it in
the collectives); an RPC is answered by every rank.

Failure: a watcher thread waits on every worker's process sentinel. A worker that dies, or one that
answers with an error, fails every pending call at once and every later one, and calls the failure
callback (the engine core's busy loop wakes on it even when idle); the engine core then ends its
requests and stops, and `shutdown` terminates the remaining workers (which may be stuck in a
collective with the dead one). Workers watch the engine core's process and exit with it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kestrel.config import EngineConfig
from kestrel.distributed import destroy_distributed_environment
from kestrel.distributed.cpu_binding import bind_to_cpu_slice
from kestrel.distributed.lifecycle import (
    allow_child_processes,
    exit_with_parent,
    free_tcp_port,
    freeze_startup_heap,
    inherit_program_logging,
)
from kestrel.messages import ModelRunnerOutput, SchedulerOutput
from kestrel.model.loader import ModelSource
from kestrel.worker.executor import Executor, WorkerMethod, call_worker
from kestrel.worker.worker import Worker

logger = logging.getLogger(__name__)

# Message kinds, engine core -> workers.
EXECUTE = b"E"     # payload: a msgspec-encoded SchedulerOutput
RPC = b"R"         # payload: pickled (method, args, kwargs)
STOP = b"S"
# Answer status, workers -> engine core.
OK = b"o"
ERROR = b"e"
READY_CALL_ID = 0  # the call id of each worker's start-up answer

STARTUP_TIMEOUT_S = 600.0
TERMINATE_GRACE_S = 1.0
ANSWER_POLL_MS = 100


@dataclass
class BroadcastStats:
    """What went over the broadcast: steps published (each once, whatever the world size), their
    encoded bytes and the time spent encoding and publishing them, and the step answers received."""
    steps: int = 0
    step_bytes: int = 0
    step_publish_s: float = 0.0
    step_answers: int = 0


class WorkerFailed(RuntimeError):
    """A worker process died or raised; the executor serves no more."""


@dataclass
class _PendingCall:
    future: Future
    ranks: set[int]                       # ranks still to answer
    results: dict[int, Any] = field(default_factory=dict)
    decode: Callable[[bytes], Any] = pickle.loads


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        allow_child_processes()
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._failure: WorkerFailed | None = None
        self._failure_callbacks: list[Callable[[WorkerFailed], None]] = []
        self._pending: dict[int, _PendingCall] = {}
        self._lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._shutting_down = False
        self._encoder = msgspec.msgpack.Encoder()
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self.stats = BroadcastStats()

        sock_dir = tempfile.mkdtemp(prefix="kestrel-workers-")
        broadcast_addr, answer_addr = f"ipc://{sock_dir}/steps", f"ipc://{sock_dir}/answers"
        self._ctx = zmq.Context()
        self._broadcast = self._ctx.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per worker
        self._broadcast.setsockopt(zmq.SNDHWM, 0)
        self._broadcast.bind(broadcast_addr)
        self._answers = self._ctx.socket(zmq.PULL)
        self._answers.bind(answer_addr)
        self._sock_dir = sock_dir

        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.processes = []
        for rank in range(self.world_size):
            proc = ctx.Process(target=run_worker, name=f"kestrel-worker-{rank}", daemon=True,
                               args=(self.config, self.source, rank, init_method, broadcast_addr, answer_addr))
            proc.start()
            self.processes.append(proc)
        try:
            self._wait_for_subscribers()
            self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self._answer_thread = threading.Thread(target=self._read_answers, name="kestrel-executor-answers",
                                               daemon=True)
        self._answer_thread.start()
        self._watch_thread = threading.Thread(target=self._watch_workers, name="kestrel-executor-watch", daemon=True)
        self._watch_thread.start()

    # ---- start-up ----------------------------------------------------------------------------

    def _wait_for_subscribers(self) -> None:
        """Until every worker has subscribed, a published message would not reach it (ZeroMQ drops
        messages for subscribers that have not joined yet)."""
        joined = 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while joined < self.world_size:
            if self._broadcast.poll(500):
                if self._broadcast.recv()[:1] == b"\x01":
                    joined += 1
            self._check_started(deadline)

    def _wait_until_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.world_size:
            if self._answers.poll(500):
                call_id, rank, status, payload = self._answers.recv_multipart()
                if int(call_id) != READY_CALL_ID:
                    continue
                if status == ERROR:
                    raise WorkerFailed(f"worker rank {int(rank)} failed to start: {payload.decode()}")
                ready.add(int(rank))
            self._check_started(deadline)
        logger.info("%d workers ready (mp executor)", self.world_size)

    def _check_started(self, deadline: float) -> None:
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                raise WorkerFailed(f"worker rank {rank} exited during start-up (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise WorkerFailed(f"the workers did not start within {STARTUP_TIMEOUT_S:.0f} s")

    # ---- calls -------------------------------------------------------------------------------

    def register_failure_callback(self, callback: Callable[[WorkerFailed], None]) -> None:
        self._failure_callbacks.append(callback)

    def collective_rpc(self, method: WorkerMethod, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        future = self._publish(RPC, pickle.dumps((method, args, kwargs)), set(range(self.world_size)),
                               pickle.loads)
        results = future.result()
        return [results[rank] for rank in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        start = time.perf_counter()
        payload = self._encoder.encode(scheduler_output)
        future = self._publish(EXECUTE, payload, {self.output_rank}, self._decode_step_answer)
        self.stats.steps += 1
        self.stats.step_bytes += len(payload)
        self.stats.step_publish_s += time.perf_counter() - start
        step = Future()
        future.add_done_callback(lambda f: _chain(f, step, lambda results: results[self.output_rank]))
        return step if non_block else step.result()

    def _decode_step_answer(self, payload: bytes) -> ModelRunnerOutput:
        self.stats.step_answers += 1
        return self._output_decoder.decode(payload)

    def _publish(self, kind: bytes, payload: bytes, ranks: set[int], decode: Callable[[bytes], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(WorkerFailed(str(self._failure)))
                return future
            call_id = next(self._call_ids)
            self._pending[call_id] = _PendingCall(future, set(ranks), decode=decode)
            self._broadcast.send_multipart([str(call_id).encode(), kind, payload], copy=False)
        return future

    def _read_answers(self) -> None:
        # This thread alone uses the answer socket once the workers are up (ZeroMQ sockets are not
        # thread-safe), and polls so that it notices shutdown.
        while not self._shutting_down:
            if not self._answers.poll(ANSWER_POLL_MS):
                continue
            call_id, rank, status, payload = self._answers.recv_multipart()
            rank_i = int(rank)
            if status == ERROR:
                self._fail(WorkerFailed(f"worker rank {rank_i} raised: {payload.decode()}"))
                continue
            with self._lock:
                call = self._pending.get(int(call_id))
                if call is None:
                    continue
                call.results[rank_i] = call.decode(payload)
                call.ranks.discard(rank_i)
                if call.ranks:
                    continue
                del self._pending[int(call_id)]
            call.future.set_result(call.results)

    def _watch_workers(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.processes)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._shutting_down:
            return
        rank = sentinels[ready[0]]
        proc = self.processes[rank]
        proc.join(timeout=0.1)
        self._fail(WorkerFailed(f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"))

    def _fail(self, failure: WorkerFailed) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            pending, self._pending = self._pending, {}
        logger.error("%s", failure)
        for call in pending.values():
            call.future.set_exception(WorkerFailed(str(failure)))
        for callback in self._failure_callbacks:
            callback(failure)

    # ---- stop --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        if self._failure is None:
            try:
                self._broadcast.send_multipart([b"0", STOP, b""])
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + (TERMINATE_GRACE_S if self._failure is None else 0.0)
        for proc in self.processes:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            proc.join(timeout=TERMINATE_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=TERMINATE_GRACE_S)
        answer_thread = getattr(self, "_answer_thread", None)
        if answer_thread is not None:
            answer_thread.join(timeout=1.0)
        self._broadcast.close(linger=0)
        self._answers.close(linger=0)
        self._ctx.term()
        for name in ("steps", "answers"):
            try:
                os.unlink(os.path.join(self._sock_dir, name))
            except OSError:
                pass


def _chain(source: Future, target: Future, pick: Callable[[Any], Any]) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(pick(source.result()))


# ---- the worker process ---------------------------------------------------------------------------

def run_worker(config: EngineConfig, source: ModelSource, rank: int, init_method: str,
               broadcast_addr: str, answer_addr: str) -> None:
    """Entry point of a worker process: join, load, then run every published message in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when workers stop
    exit_with_parent()
    inherit_program_logging()
    pc = config.parallel
    if config.device.device.type == "cpu":
        bind_to_cpu_slice(pc.data_parallel_rank * pc.world_size + rank, pc.num_local_workers,
                          f"engine core {pc.data_parallel_rank} worker rank {rank}")
    ctx = zmq.Context()
    steps = ctx.socket(zmq.SUB)
    steps.setsockopt(zmq.SUBSCRIBE, b"")
    steps.setsockopt(zmq.RCVHWM, 0)
    steps.connect(broadcast_addr)
    answers = ctx.socket(zmq.PUSH)
    answers.setsockopt(zmq.LINGER, 2000)
    answers.connect(answer_addr)
    rank_b = str(rank).encode()
    try:
        worker = Worker(config, source, rank=rank, local_rank=rank, distributed_init_method=init_method)
    except Exception:
        answers.send_multipart([str(READY_CALL_ID).encode(), rank_b, ERROR, traceback.format_exc().encode()])
        raise
    freeze_startup_heap()
    answers.send_multipart([str(READY_CALL_ID).encode(), rank_b, OK, b""])
    WorkerLoop(worker, steps, answers, rank_b, is_output_rank=rank == pc.world_size - pc.tensor_parallel_size).run()
    del worker
    destroy_distributed_environment()  # frees the shared-memory all-reduce segment
    answers.close()
    steps.close()
    ctx.term()


class WorkerLoop:
    def __init__(self, worker: Worker, steps: zmq.Socket, answers: zmq.Socket, rank: bytes,
                 is_output_rank: bool) -> None:
        self.worker, self.steps, self.answers, self.rank = worker, steps, answers, rank
        self.is_output_rank = is_output_rank
        self.decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.encoder = msgspec.msgpack.Encoder()

    def run(self) -> None:
        while True:
            call_id, kind, payload = self.steps.recv_multipart()
            if kind == STOP:
                return
            try:
                answer = self._run_one(kind, payload)
            except Exception:  # noqa: BLE001 - sent to the engine core, which stops every worker
                logger.exception("worker rank %s: a call failed", self.rank.decode())
                self.answers.send_multipart([call_id, self.rank, ERROR, traceback.format_exc().encode()])
                continue
            if answer is not None:
                self.answers.send_multipart([call_id, self.rank, OK, answer])

    def _run_one(self, kind: bytes, payload: bytes) -> bytes | None:
        if kind == EXECUTE:
            output = self.worker.execute_model(self.decoder.decode(payload))
            return self.encoder.encode(output) if self.is_output_rank else None
        method, args, kwargs = pickle.loads(payload)
        return pickle.dumps(call_worker(self.worker, method, args, kwargs))
