"""One worker per device: sets the device up, holds the weights and the KV memory, runs steps.

A worker is one rank of its engine core's world (tensor x pipeline parallel ranks, see
`ParallelConfig`): `rank` within that world, `local_rank` its device index on its machine."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kestrel.attention import select_attention_backend
from kestrel.config import EngineConfig
from kestrel.distributed import init_distributed_environment
from kestrel.distributed.thread_governor import ThreadGovernor, governor_for_worker
from kestrel.messages import ModelRunnerOutput, SchedulerOutput
from kestrel.model import build_model, local_attention_config, shard_of_this_rank
from kestrel.model.layers import pack_linear_weights_
from kestrel.model.loader import ModelSource, resolve_model, weight_reader
from kestrel.model.quantization import keep_gguf_blocks_, pack_gguf_weights_, quantize_model_
from kestrel.ops.huge_pages import move_to_huge_pages, return_freed_memory
from kestrel.worker.memory import MemoryProfile, num_blocks_for, profile_cpu, profile_cuda
from kestrel.worker.model_runner import ModelRunner
from kestrel.worker.spec_decode import DraftModelProposer

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        """`distributed_init_method`: the world's rendezvous (tcp://host:port), needed when the world
        has more than one rank; the world is joined before the model is built (its shard depends on
        the rank)."""
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        parallel = config.parallel
        self.world_size = parallel.world_size
        if not 0 <= rank < self.world_size:
            raise ValueError(f"worker rank {rank} is outside a world of {self.world_size}")
        self.device = config.device.device
        if self.device.type == "cuda":
            if self.world_size > 1:
                self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            if distributed_init_method is None:
                raise ValueError("a world of several ranks needs distributed_init_method")
            init_distributed_environment(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                         distributed_init_method, "nccl" if self.device.type == "cuda" else "gloo")
        torch.manual_seed(config.seed)
        self.threads = self._thread_governor()
        # This rank's part of the model (all of it in a world of one); its attention sees its own heads.
        self.shard = shard_of_this_rank(config.model)
        self.attn_backend = select_attention_backend(local_attention_config(config, self.shard))  # once
        start = time.perf_counter()
        self.model = build_model(config.model, self.device, self.attn_backend)
        kept = self._read_weights(source)
        quantize_model_(self.model, config.model.quantization)
        packed = pack_linear_weights_(self.model) + pack_gguf_weights_(self.model)
        in_huge_pages = self._into_huge_pages(self.model)
        logger.info("loaded %s in %.1f s; attention backend: %s%s%s%s", source.name, time.perf_counter() - start,
                    self.attn_backend.describe(), f"; {packed} weights packed" if packed else "",
                    f"; {kept} weights kept in the file's quantized blocks" if kept else "",
                    "; weights in huge pages" if in_huge_pages else "")
        self.runner = ModelRunner(config, self.model, self.attn_backend, self._load_draft_model())
        self.memory_profile: MemoryProfile | None = None
        self.profiler: torch.profiler.profile | None = None  # between /start_profile and /stop_profile

    def _read_weights(self, source: ModelSource) -> int:
        """The checkpoint's weights into the model, the GGUF blocks the kernels run kept as they are;
        how many were kept. The reader is closed on return, before the weights are packed and moved:
        the checkpoint's mapped pages leave the process's memory before the copies are made."""
        reader = weight_reader(source)
        kept = keep_gguf_blocks_(self.model, reader, self.config.model.quantization)
        self.model.load_weights(reader)
        return kept

    def _thread_governor(self) -> ThreadGovernor | None:
        """The CPU worker's torch pool size, decided once here and between steps after (None on GPUs).
        Ray sizes its actors' pools itself: that count stays pinned."""
        if self.device.type != "cpu":
            return None
        parallel = self.config.parallel
        pinned = self.config.device.cpu_threads
        if pinned is None and parallel.distributed_executor_backend == "ray":
            pinned = torch.get_num_threads()
        governor = governor_for_worker(pinned, leave_one_to_frontend=parallel.num_local_workers == 1,
                                       set_threads=torch.set_num_threads)
        logger.info("worker rank %d: %s", self.rank, governor.describe())
        return governor

    def _into_huge_pages(self, model: torch.nn.Module) -> bool:
        """On a CPU, the loaded weights moved into huge pages (kestrel/ops/huge_pages.py): a decode step
        streams them all from memory. Whether they were."""
        return self.device.type == "cpu" and move_to_huge_pages(model) > 0

    def _load_draft_model(self) -> DraftModelProposer | None:
        """The draft model of speculative method draft_model, with its own attention backend (its head
        shapes may differ from the target's); one worker only, so it is whole."""
        config = self.config
        if config.draft_model is None:
            return None
        draft_config = dataclasses.replace(config, model=config.draft_model)
        attn = select_attention_backend(local_attention_config(draft_config, shard_of_this_rank(config.draft_model)))
        start = time.perf_counter()
        model = build_model(config.draft_model, self.device, attn)
        source = resolve_model(config.speculative.model)
        model.load_weights(weight_reader(source))
        pack_linear_weights_(model)
        self._into_huge_pages(model)
        logger.info("loaded the draft model %s in %.1f s", source.name, time.perf_counter() - start)
        return DraftModelProposer(config, model, attn)

    def profile(self, start: bool) -> None:
        """Start or stop a torch profiler trace of this worker's process; a stopped trace is written
        to --torch-profiler-dir (one file per worker, for TensorBoard or Perfetto). Asked while already
        in that state, nothing happens."""
        folder = self.config.torch_profiler_dir
        if folder is None:
            raise RuntimeError("profiling is off: no --torch-profiler-dir")
        if start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            write = torch.profiler.tensorboard_trace_handler(folder, worker_name=f"kestrel_rank{self.rank}")
            self.profiler = torch.profiler.profile(activities=activities, on_trace_ready=write)
            self.profiler.start()
            logger.info("torch profiler started; the trace goes to %s", folder)
        elif not start and self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            logger.info("torch profiler stopped; trace written to %s", folder)

    def determine_num_kv_blocks(self) -> int:
        profile = profile_cuda if self.device.type == "cuda" else profile_cpu
        self.memory_profile = profile(self.config, self.runner.profile_run)
        if self.device.type == "cpu":
            return_freed_memory()  # the profile forward's activations: a decode step needs few of them
        return num_blocks_for(self.config, self.memory_profile, self.runner.kv_bytes_per_token())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        # Unseeded requests sample from the global generator: it starts from --seed when serving
        # starts, whatever the load and the profile forward (run or skipped) drew from it before.
        torch.manual_seed(self.config.seed)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.between_steps()  # never inside a step: the pool is resized only here
        return self.runner.execute_model(scheduler_output)
