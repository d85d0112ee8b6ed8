"""Clients of engine-core processes (kestrel/core/core_process.py), for the front ends.

    EngineCoreProcess     one engine-core process: the process, its input (PUSH) and output (PULL)
                          sockets, the start-up handshake, liveness, shutdown
    EngineCoreProcesses   the data-parallel engine cores behind one front end: started together,
                          each request routed to the least-loaded core (router.py) and its aborts
                          to the core that owns it
    SyncEngineCoreClient  the offline `LLMEngine`'s view of several engine-core processes: the same
                          calls as an in-process `EngineCore` (add, abort, step), a step drains what
                          the cores have sent

`AsyncLLM` drains the output sockets itself, one asyncio task per core.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
import weakref
from typing import Any

import msgspec
import zmq

from kestrel.config import EngineConfig
from kestrel.core import core_process
from kestrel.distributed.cpu_binding import engine_core_cpu_slice
from kestrel.distributed.thread_governor import mark_frontend
from kestrel.engine.exceptions import EngineDeadError
from kestrel.engine.router import LeastLoadedRouter
from kestrel.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from kestrel.model.loader import ModelSource

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
DEATH_POLL_S = 0.5


class EngineCoreProcess:
    """A client of one engine-core process. The process starts at construction, before its settings are
    known, and imports the engine while the front end reads the model's config and tokenizer;
    `configure` hands it its settings, and `wait_until_ready` waits for its handshake (so that several
    cores load their models at the same time)."""

    def __init__(self, rank: int, label: str) -> None:
        self.label = label  # "the engine core", or "engine core N" among several
        self.sock_dir = tempfile.mkdtemp(prefix="kestrel-")  # removed, with its sockets, at shutdown
        self.input_addr = f"ipc://{self.sock_dir}/input"
        self.output_addr = f"ipc://{self.sock_dir}/output"
        # Plain sockets, so the engine can be built outside an event loop; AsyncLLM gives the output
        # socket an asyncio view once a loop drains it.
        self._ctx = zmq.Context()
        self.input = self._ctx.socket(zmq.PUSH)
        self.input.bind(self.input_addr)
        self.output = self._ctx.socket(zmq.PULL)
        self.output.bind(self.output_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._closed = False
        self.num_kv_blocks = 0  # the core's KV pool, once it is ready
        mark_frontend()  # the workers count this process's CPU time as Kestrel's, not a neighbour's
        spawn = multiprocessing.get_context("spawn")
        self._settings, child_end = spawn.Pipe(duplex=False)[::-1]
        self.process = spawn.Process(target=core_process.run_engine_core, name=f"kestrel-engine-core-{rank}",
                                     args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()
        self.configured = False

    def configure(self, config: EngineConfig, source: ModelSource) -> None:
        """Send the process its settings: it builds the engine core, then says READY or FAILED."""
        self._settings.send((config, source, self.input_addr, self.output_addr))
        self._settings.close()
        self.configured = True

    def wait_until_ready(self, deadline: float) -> None:
        """Return once the engine core is serving; ValueError if it refused its settings, RuntimeError
        if it exited or did not answer by `deadline` (time.monotonic())."""
        poller = zmq.Poller()
        poller.register(self.output, zmq.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(timeout=500):
                kind, payload = self.output.recv_multipart()
                if kind == core_process.READY:
                    self.num_kv_blocks = msgspec.msgpack.decode(payload)["num_kv_blocks"]
                    return
                if kind == core_process.FAILED:
                    self.process.join(timeout=5)
                    raise ValueError(msgspec.msgpack.decode(payload))
            if not self.process.is_alive():
                raise RuntimeError(f"{self.label} exited during start-up (exit code {self.process.exitcode})")
        raise RuntimeError(f"{self.label} did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def send(self, kind: bytes, payload: Any) -> None:
        self.input.send_multipart([kind, self._encoder.encode(payload)], copy=False)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def shutdown(self) -> None:
        """Ask the process to stop, kill it if it does not, and close the sockets; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.configured:
            # Still importing or waiting for its settings: nothing to stop cleanly, and no peer on the
            # input socket (a send there would block).
            self._settings.close()
            self.process.kill()
            self.process.join(timeout=5)
        elif self.process.is_alive():
            try:
                self.send(core_process.SHUTDOWN, None)
            except zmq.ZMQError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self._ctx.term()
        for addr in (self.input_addr, self.output_addr):
            try:
                os.unlink(addr.removeprefix("ipc://"))
            except OSError:
                pass
        try:
            os.rmdir(self.sock_dir)
        except OSError:
            pass


def engine_core_label(data_parallel_size: int, rank: int) -> str:
    return "the engine core" if data_parallel_size == 1 else f"engine core {rank}"


def prestart_engine_cores(data_parallel_size: int) -> list[EngineCoreProcess]:
    """One engine-core process per data-parallel rank, started before the model is read (see
    `EngineCoreProcess`); `start_engine_cores` configures them, or `stop_engine_cores` ends them."""
    cores: list[EngineCoreProcess] = []
    try:
        for rank in range(data_parallel_size):
            cores.append(EngineCoreProcess(rank, engine_core_label(data_parallel_size, rank)))
    except BaseException:
        stop_engine_cores(cores)
        raise
    return cores


def stop_engine_cores(cores: list[EngineCoreProcess]) -> None:
    for core in cores:
        core.shutdown()


def start_engine_cores(config: EngineConfig, source: ModelSource,
                       prestarted: list[EngineCoreProcess] | None = None) -> list[EngineCoreProcess]:
    """The engine-core processes (`prestarted`, or new ones), each configured with `data_parallel_rank`
    set; returns once every one is ready, or stops them all and raises."""
    size = config.parallel.data_parallel_size
    cores = prestarted if prestarted is not None else prestart_engine_cores(size)
    try:
        assert len(cores) == size, (len(cores), size)
        for rank, core in enumerate(cores):
            rank_config = dataclasses.replace(
                config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank))
            log_cpu_slice(rank_config)
            core.configure(rank_config, source)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for core in cores:
            core.wait_until_ready(deadline)
    except BaseException:
        stop_engine_cores(cores)
        raise
    return cores


def log_cpu_slice(config: EngineConfig) -> None:
    """The engine core binds itself (core_process.serve_engine_core); its log lines may go nowhere, so the
    front end says which cores it will use."""
    chosen = engine_core_cpu_slice(config.parallel)
    if chosen is not None:
        logger.info("engine core %d of %d: cores %s, %d threads%s", config.parallel.data_parallel_rank,
                    config.parallel.data_parallel_size, ",".join(map(str, chosen.cores)), chosen.num_threads,
                    " (more engine cores than CPU cores: cores are shared)" if chosen.shared else "")


class EngineCoreProcesses:
    """The engine-core processes of one front end, and which of them owns each request."""

    def __init__(self, config: EngineConfig, source: ModelSource,
                 prestarted: list[EngineCoreProcess] | None = None) -> None:
        self.cores = start_engine_cores(config, source, prestarted)
        self.router = LeastLoadedRouter(len(self.cores))

    def __len__(self) -> int:
        return len(self.cores)

    def add_requests(self, requests: list[EngineCoreRequest]) -> int:
        """Send the engine-core requests of one user request (its samples) to the least-loaded core;
        returns that core's index."""
        index = self.router.assign([r.request_id for r in requests])
        for request in requests:
            self.cores[index].send(core_process.ADD, request)
        return index

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort engine-core requests in the cores that own them (ids no core owns any more are skipped)."""
        for index, ids in self.router.release(request_ids).items():
            self.cores[index].send(core_process.ABORT, ids)

    def record_outputs(self, index: int, outputs: EngineCoreOutputs) -> None:
        """What the router learns from one core's outputs: its load, and which requests ended there."""
        if outputs.scheduler_stats is not None:
            self.router.record_stats(index, outputs.scheduler_stats)
        finished = [out.request_id for out in outputs.outputs if out.finished]
        if finished:
            self.router.release(finished)

    def dead_core(self) -> EngineCoreProcess | None:
        return next((core for core in self.cores if not core.is_alive()), None)

    def shutdown(self) -> None:
        stop_engine_cores(self.cores)


class SyncEngineCoreClient:
    """Several engine-core processes behind the offline `LLMEngine`, answering the calls it makes of an
    in-process `EngineCore`. A failed or dead core raises from `step` (the engine is then dead)."""

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.processes = EngineCoreProcesses(config, source)
        self._latest: list[SchedulerStats | None] = [None] * len(self.processes)
        self._poller = zmq.Poller()
        for core in self.processes.cores:
            self._poller.register(core.output, zmq.POLLIN)
        # Garbage collection or interpreter exit stops the processes too (they are daemons besides).
        self._finalizer = weakref.finalize(self, EngineCoreProcesses.shutdown, self.processes)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.processes.add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.processes.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.processes.router.num_owned > 0

    @property
    def num_kv_blocks(self) -> int:
        """The KV blocks of every core together."""
        return sum(core.num_kv_blocks for core in self.processes.cores)

    def reset_prefix_cache(self) -> None:
        """Every core drops its cached prefix blocks (before its next step; call it while idle)."""
        for core in self.processes.cores:
            core.send(core_process.RESET_PREFIX_CACHE, None)

    def step(self) -> EngineCoreOutputs:
        """Everything the cores have sent, waiting up to `DEATH_POLL_S` for the first message."""
        ready = dict(self._poller.poll(timeout=int(DEATH_POLL_S * 1000)))
        if not ready:
            self._check_alive()
            return EngineCoreOutputs()
        outputs: list = []
        step_stats: list[SchedulerStats] = []
        for index, core in enumerate(self.processes.cores):
            for received in self._drain(index, core):
                outputs.extend(received.outputs)
                if received.scheduler_stats is not None:
                    step_stats.append(received.scheduler_stats)
        stats = merge_step_stats(self._latest, step_stats) if step_stats else None
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _drain(self, index: int, core: EngineCoreProcess) -> list[EngineCoreOutputs]:
        received = []
        while True:
            try:
                kind, payload = core.output.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return received
            if kind == core_process.DEAD:
                failure = core_process.decode_failure(payload)
                raise EngineDeadError(f"{core.label} failed: {failure.message}")
            if kind == core_process.OUTPUTS:
                outputs = core_process.decode_outputs(payload)
                self.processes.record_outputs(index, outputs)
                if outputs.scheduler_stats is not None:
                    self._latest[index] = outputs.scheduler_stats
                received.append(outputs)

    def _check_alive(self) -> None:
        dead = self.processes.dead_core()
        if dead is not None:
            raise EngineDeadError(f"{dead.label} died (exit code {dead.exitcode})")

    def shutdown(self) -> None:
        self._finalizer()


def merge_gauges(latest: list[SchedulerStats | None]) -> SchedulerStats | None:
    """The cores' latest states as one: requests running and waiting summed, KV-cache usage averaged
    (every core has a pool of the same size); None before any core has reported."""
    known = [s for s in latest if s is not None]
    if not known:
        return None
    return SchedulerStats(num_running_reqs=sum(s.num_running_reqs for s in known),
                          num_waiting_reqs=sum(s.num_waiting_reqs for s in known),
                          kv_cache_usage=sum(s.kv_cache_usage for s in latest if s is not None) / len(latest))


def merge_step_stats(latest: list[SchedulerStats | None], step_stats: list[SchedulerStats]) -> SchedulerStats:
    """One report for several cores' steps: their latest gauges (merge_gauges) and the counts of every
    step summed."""
    merged = merge_gauges(latest) or SchedulerStats()
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_prompt_tokens",
                 "num_generation_tokens"):
        setattr(merged, name, sum(getattr(s, name) for s in step_stats))
    return merged
