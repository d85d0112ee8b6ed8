"""Workers as Ray actors (`--distributed-executor-backend ray`): the executor for more than one machine.

The engine core joins the Ray cluster named by `RAY_ADDRESS` (or one already joined in this process,
or else a local one that Ray starts), reserves one bundle per rank in a placement group (a CPU share,
or a GPU), and starts a `RayWorker` actor in each. The actors rendezvous over torch.distributed at
rank 0's address, as the mp executor's processes do, and the collectives between them are the same
(gloo on CPU, NCCL on CUDA).

A step's `SchedulerOutput` is put in Ray's object store once and every actor reads that one object
(Ray's broadcast); every rank runs it, the output rank's answer is the step's, and an error from any
rank (or an actor that dies) fails the step and every later call.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from kestrel.config import EngineConfig
from kestrel.messages import ModelRunnerOutput, SchedulerOutput
from kestrel.model.loader import ModelSource
from kestrel.worker.executor import Executor, WorkerMethod, call_worker
from kestrel.worker.worker import Worker

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


class RayWorker:
    """The actor around one worker: built empty, then given its rank once the world's rendezvous is known."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_address(self) -> tuple[str, int]:
        """This actor's node IP and a port free on it (rank 0's is the world's rendezvous)."""
        import ray

        from kestrel.distributed.lifecycle import free_tcp_port
        ip = ray.util.get_node_ip_address()
        return ip, free_tcp_port("0.0.0.0")

    def init_worker(self, config: EngineConfig, source: ModelSource, rank: int, init_method: str,
                    num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        logger.info("ray worker rank %d: %d threads (pid %d)", rank, num_threads, os.getpid())
        # Ray shows each GPU actor only its own device, so the local rank is 0.
        self.worker = Worker(config, source, rank=rank, local_rank=0, distributed_init_method=init_method)

    def execute_method(self, method: WorkerMethod, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        return call_worker(self.worker, method, args, kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.worker.execute_model(scheduler_output)


class RayExecutor(Executor):
    def _init_executor(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                     logging_level=logging.WARNING)
        self._failure: Exception | None = None
        self._failure_callbacks: list[Callable[[Exception], None]] = []
        self._lock = threading.Lock()
        world = self.parallel_config.world_size
        on_gpu = self.config.device.device.type == "cuda"
        cpus = self._cpus_per_worker()
        bundle = {"GPU": 1, "CPU": 1} if on_gpu else {"CPU": cpus}
        self._placement_group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ready, _ = ray.wait([self._placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self._placement_group)
            raise RuntimeError(f"the Ray cluster could not place {world} workers of {bundle} within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})")
        actor_cls = ray.remote(RayWorker)
        self.workers = [
            actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=self._placement_group, placement_group_bundle_index=rank)
                              ).remote()
            for rank in range(world)]
        try:
            ip, port = ray.get(self.workers[0].node_address.remote())
            init_method = f"tcp://{ip}:{port}"
            ray.get([w.init_worker.remote(self.config, self.source, rank, init_method, int(bundle["CPU"]))
                     for rank, w in enumerate(self.workers)])
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray workers ready (%s each; rendezvous %s)", world, bundle, init_method)

    def _cpus_per_worker(self) -> int:
        """This engine core's workers share the cluster's CPUs with the other engine cores' evenly."""
        total = int(self._ray.cluster_resources().get("CPU", 1))
        return max(1, total // self.parallel_config.num_local_workers)

    # ---- calls -------------------------------------------------------------------------------

    def register_failure_callback(self, callback: Callable[[Exception], None]) -> None:
        self._failure_callbacks.append(callback)

    def collective_rpc(self, method: WorkerMethod, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._check_alive()
        try:
            return self._ray.get([w.execute_method.remote(method, args, kwargs) for w in self.workers])
        except Exception as exc:
            self._fail(exc)
            raise

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        step: Future = Future()
        if self._failure is not None:
            step.set_exception(RuntimeError(f"a Ray worker failed: {self._failure}"))
            return step if non_block else step.result()
        shared = self._ray.put(scheduler_output)  # stored once, read by every actor
        refs = [w.execute_model.remote(shared) for w in self.workers]
        for rank, ref in enumerate(refs):
            ref.future().add_done_callback(lambda f, rank=rank: self._on_rank_done(step, rank, f))
        return step if non_block else step.result()

    def _on_rank_done(self, step: Future, rank: int, done: Future) -> None:
        error = done.exception()
        if error is not None:
            self._fail(error)
            if not step.done():
                step.set_exception(RuntimeError(f"Ray worker rank {rank} failed: {error}"))
        elif rank == self.output_rank and not step.done():
            step.set_result(done.result())

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"a Ray worker failed: {self._failure}")

    def _fail(self, error: Exception) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
        logger.error("a Ray worker failed: %s", error)
        for callback in self._failure_callbacks:
            callback(error)

    def shutdown(self) -> None:
        ray = self._ray
        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
        if getattr(self, "_placement_group", None) is not None:
            ray.util.remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
