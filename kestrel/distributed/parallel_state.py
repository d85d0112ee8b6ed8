"""The process groups of one engine core's world and the collectives the model and runner use.

A world is tensor x pipeline parallel ranks, numbered as vLLM numbers them: rank = pp_rank * tp + tp_rank,
so the ranks of one pipeline stage are consecutive (a tensor-parallel group) and the ranks with the
same tensor rank across stages form a pipeline group. Collectives go through torch.distributed: gloo
on CPU, NCCL on CUDA; on CPU the tensor-parallel all-reduce of ranks on one machine goes through shared
memory instead (kestrel/distributed/shm_all_reduce.py: ~20x faster than gloo's for decode-sized tensors),
chosen once when the group is built (`KESTREL_CPU_ALL_REDUCE=gloo` keeps gloo's).

State is per process (one worker per process), set once by `init_distributed_environment` before the
model is built; until then every group is a world of one whose collectives are identities.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kestrel import envs

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process group as seen from one member: its global ranks, this process's place in it, and
    the collectives over it. With one member every collective returns its input."""
    ranks: list[int]            # global ranks of the members, in group order
    rank_in_group: int
    group: dist.ProcessGroup | None = None   # None for a group of one
    # How this group sums: torch.distributed's all-reduce, or the shared-memory one (set once, when built).
    _all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    all_reduce_kind: str = "none"

    def __post_init__(self) -> None:
        if self._all_reduce is None:
            self._all_reduce = self._dist_all_reduce if self.world_size > 1 else _identity
            self.all_reduce_kind = "torch.distributed" if self.world_size > 1 else "none"

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `t`."""
        return self._all_reduce(t)

    def _dist_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every member's `t` (same shape on all) concatenated along `dim` on member `dst`; None elsewhere."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(t, parts, dst=self.ranks[dst], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Point to point to member `dst` (blocking until the peer has it on gloo)."""
        dist.send(t.contiguous(), dst=self.ranks[dst], group=self.group)

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `t` (shape and dtype agreed beforehand) from member `src`."""
        dist.recv(t, src=self.ranks[src], group=self.group)
        return t

    @property
    def next_rank(self) -> int:
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        return (self.rank_in_group - 1) % self.world_size


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


_TP: GroupCoordinator = GroupCoordinator([0], 0)
_PP: GroupCoordinator = GroupCoordinator([0], 0)
_SHM = None  # this process's shared-memory all-reduce segment, if any (closed with the world)


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (the ranks of its pipeline stage)."""
    return _TP


def get_pp_group() -> GroupCoordinator:
    """This process's pipeline group (its tensor rank in every stage, first stage first)."""
    return _PP


def init_distributed_environment(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                                 init_method: str, backend: str = "gloo") -> None:
    """Join the world (`init_method`: the rendezvous, e.g. tcp://host:port) and build its groups.
    Every rank must call it with the same sizes; it returns once all have joined."""
    global _TP, _PP
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world_size = tp * pp
    if world_size == 1:
        _TP = _PP = GroupCoordinator([0], 0)
        return
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank)
    # Every rank creates every group, in the same order (torch.distributed requires it), and keeps its own.
    for stage in range(pp):
        ranks = [stage * tp + t for t in range(tp)]
        group = dist.new_group(ranks, backend=backend) if tp > 1 else None
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group)
    if backend == "gloo" and tp > 1:
        _use_shared_memory_all_reduce(_TP)
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        group = dist.new_group(ranks, backend=backend) if pp > 1 else None
        if rank in ranks:
            _PP = GroupCoordinator(ranks, ranks.index(rank), group)
    logger.info("rank %d of %d: tensor rank %d of %d, pipeline stage %d of %d (%s; tensor-parallel all-reduce: %s)",
                rank, world_size, _TP.rank_in_group, tp, _PP.rank_in_group, pp, backend, _TP.all_reduce_kind)


def _use_shared_memory_all_reduce(group: GroupCoordinator) -> None:
    """Switch the group's all-reduce to shared memory when all its ranks are on this machine (unless
    KESTREL_CPU_ALL_REDUCE=gloo). Collective: every rank of the group calls it."""
    from kestrel.distributed.shm_all_reduce import ShmAllReduce
    hosts: list[str | None] = [None] * group.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=group.group)
    if envs.KESTREL_CPU_ALL_REDUCE == "gloo" or len(set(hosts)) != 1:
        return
    name = [f"kestrel_tp_{uuid.uuid4().hex[:16]}"]
    dist.broadcast_object_list(name, src=group.ranks[0], group=group.group)
    if group.is_first_rank:
        shm = ShmAllReduce(name[0], 0, group.world_size)
    dist.barrier(group=group.group)  # the segment exists before the others attach
    if not group.is_first_rank:
        shm = ShmAllReduce(name[0], group.rank_in_group, group.world_size)
    dist.barrier(group=group.group)
    global _SHM
    _SHM = shm
    group._all_reduce = shm.all_reduce
    group.all_reduce_kind = "shared memory"


def destroy_distributed_environment() -> None:
    global _TP, _PP, _SHM
    if _SHM is not None:
        _SHM.close()
        _SHM = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = _PP = GroupCoordinator([0], 0)
