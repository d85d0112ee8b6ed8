"""An all-reduce through shared memory, for the tensor-parallel ranks of one machine's CPU workers.

gloo's all-reduce goes through the loopback TCP stack and its own threads: on 2 cores, one rank
each, a 1-row [1, 576] bf16 all-reduce took 362 us (benchmarks/parallel_comm.py, 2026-12-01), and a
decode step of a 30-layer model makes 61 of them. Here every rank copies its tensor into its own
slot of a shared segment, raises its flag, waits for every rank's flag, and sums the slots in rank
order into its tensor, so every rank gets the same bits (vLLM's CPU backend has a shared-memory
all-reduce for the same reason). With two ranks the sum is gloo's to the bit; with more, gloo's ring
adds in another order, so the last bits may differ from gloo's (never between ranks).

Invariants: a call's sequence number is the same on every rank (they make the same calls in the same
order). Slots alternate between two halves by parity, and a rank writes a half only after every rank
has finished reading it from the call two before, so a fast rank never overwrites what a slow one is
still summing. Tensors larger than a slot go through in chunks.

Waiting spins briefly, then yields the CPU on every check: with more ranks than cores (the default
model at -tp 3 on 2 cores) a spinning rank must let the rank it waits for run.
"""

from __future__ import annotations

import os
from multiprocessing import shared_memory

import numpy as np
import torch

SLOT_BYTES = 8 << 20     # per rank and half; a bigger tensor goes through in chunks
SPIN_CHECKS = 2000       # busy checks before each wait starts yielding the CPU
_FLAG_BYTES = 64         # one cache line per flag


class ShmAllReduce:
    """The shared segment of one group. Rank 0 creates it (`name` must be new); the others attach
    after it exists (the caller orders that with a barrier)."""

    def __init__(self, name: str, rank: int, world_size: int, slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        flags = 2 * world_size * _FLAG_BYTES       # written[rank], read[rank]
        size = flags + 2 * world_size * slot_bytes
        if rank == 0:
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        buf = self.shm.buf
        self.written = np.ndarray((world_size,), dtype=np.int64, buffer=buf, offset=0, strides=(_FLAG_BYTES,))
        self.read = np.ndarray((world_size,), dtype=np.int64, buffer=buf, offset=world_size * _FLAG_BYTES,
                               strides=(_FLAG_BYTES,))
        if rank == 0:
            self.written[:] = 0
            self.read[:] = 0
        self.slots = torch.frombuffer(buf, dtype=torch.uint8, offset=flags, count=2 * world_size * slot_bytes
                                      ).view(2, world_size, slot_bytes)
        self.seq = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place (a contiguous CPU tensor); returns `t`."""
        flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
        step = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), step):
            self._all_reduce_chunk(flat[start:start + step])
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view_as(t))
        return t

    def _all_reduce_chunk(self, chunk: torch.Tensor) -> None:
        self.seq += 1
        seq, half = self.seq, self.seq & 1
        nbytes = chunk.numel() * chunk.element_size()
        # This half was last used by call seq - 2: every rank must have read it before it is overwritten.
        self._wait_all(self.read, seq - 2)
        mine = self.slots[half, self.rank, :nbytes].view(chunk.dtype)
        mine.copy_(chunk)
        self.written[self.rank] = seq
        self._wait_all(self.written, seq)
        parts = [self.slots[half, r, :nbytes].view(chunk.dtype) for r in range(self.world_size)]
        torch.add(parts[0], parts[1], out=chunk)
        for part in parts[2:]:
            chunk.add_(part)
        self.read[self.rank] = seq

    @staticmethod
    def _wait_all(flags: np.ndarray, seq: int) -> None:
        checks = 0
        while flags.min() < seq:
            checks += 1
            if checks > SPIN_CHECKS:
                os.sched_yield()

    def close(self) -> None:
        self.written = self.read = self.slots = None  # drop the views before the mapping goes
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self.rank == 0:
            self.shm.unlink()
