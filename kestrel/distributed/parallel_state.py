"""The process groups of one engine core's world and the collectives the model and runner use.

A world is tensor x pipeline parallel ranks, numbered as vLLM numbers them: rank = pp_rank * tp + tp_rank,
so the ranks of one pipeline stage are consecutive (a tensor-parallel group) and the ranks with the
same tensor rank across stages form a pipeline group. Collectives go through torch.distributed: gloo
on CPU, NCCL on CUDA.

State is per process (one worker per process), set once by `init_distributed_environment` before the
model is built; until then every group is a world of one whose collectives are identities.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process group as seen from one member: its global ranks, this process's place in it, and
    the collectives over it. With one member every collective returns its input."""
    ranks: list[int]            # global ranks of the members, in group order
    rank_in_group: int
    group: dist.ProcessGroup | None = None   # None for a group of one

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
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's `t` (same shape on all) concatenated along `dim`, in group order."""
        if self.world_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every member's `t` (same shape on all) concatenated along `dim` on member `dst`; None elsewhere."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(t, parts, dst=self.ranks[dst], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Member `src`'s `t` into every member's `t` (same shape and dtype on all), in place."""
        if self.world_size > 1:
            dist.broadcast(t, src=self.ranks[src], group=self.group)
        return t

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


_TP: GroupCoordinator = GroupCoordinator([0], 0)
_PP: GroupCoordinator = GroupCoordinator([0], 0)
_WORLD: GroupCoordinator = GroupCoordinator([0], 0)


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (the ranks of its pipeline stage)."""
    return _TP


def get_pp_group() -> GroupCoordinator:
    """This process's pipeline group (its tensor rank in every stage, first stage first)."""
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def init_distributed_environment(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                                 init_method: str, backend: str = "gloo") -> None:
    """Join the world (`init_method`: the rendezvous, e.g. tcp://host:port) and build its groups.
    Every rank must call it with the same sizes; it returns once all have joined."""
    global _TP, _PP, _WORLD
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    world_size = tp * pp
    if world_size == 1:
        _TP = _PP = _WORLD = GroupCoordinator([0], 0)
        return
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size, rank=rank)
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD)
    # Every rank creates every group, in the same order (torch.distributed requires it), and keeps its own.
    for stage in range(pp):
        ranks = [stage * tp + t for t in range(tp)]
        group = dist.new_group(ranks, backend=backend) if tp > 1 else None
        if rank in ranks:
            _TP = GroupCoordinator(ranks, ranks.index(rank), group)
    for t in range(tp):
        ranks = [stage * tp + t for stage in range(pp)]
        group = dist.new_group(ranks, backend=backend) if pp > 1 else None
        if rank in ranks:
            _PP = GroupCoordinator(ranks, ranks.index(rank), group)
    logger.info("rank %d of %d: tensor rank %d of %d, pipeline stage %d of %d (%s)", rank, world_size,
                _TP.rank_in_group, tp, _PP.rank_in_group, pp, backend)


def destroy_distributed_environment() -> None:
    global _TP, _PP, _WORLD
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = _PP = _WORLD = GroupCoordinator([0], 0)
