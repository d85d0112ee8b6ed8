"""CPU memory in transparent huge pages (2 MiB) for what a decode step streams: the weights and the KV
cache.

A batch-1 decode step reads every weight once from DRAM. On 4 KiB pages that stream crosses a page
every 64 cache lines, and each crossing costs a TLB miss and restarts the hardware prefetcher; on 2 MiB
pages it runs longer (the measured gain: docs/kernels.md). llama.cpp reads its weights from the file's
page cache, on 4 KiB pages.

Linux hands out huge pages to an anonymous mapping that asks for them (madvise MADV_HUGEPAGE) when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (most distributions' default);
under `never`, or where the kernel cannot find free 2 MiB pages, the same memory is mapped in 4 KiB
pages and everything works as before. KESTREL_DISABLE_HUGE_PAGES=1 turns this off (for comparisons).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Callable

import numpy as np
import torch

from kestrel import envs

HUGE_PAGE = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_disabled() -> bool:
    """KESTREL_DISABLE_HUGE_PAGES=1: weights and KV cache in ordinary pages."""
    return envs.KESTREL_DISABLE_HUGE_PAGES


def transparent_huge_pages() -> str | None:
    """The kernel's setting (`always`, `madvise` or `never`), or None where there is none (not Linux)."""
    try:
        with open(_THP_SETTING) as f:
            text = f.read()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def huge_pages_available() -> bool:
    """Whether memory asked for here can come in huge pages. Read at each allocation, of which a worker
    makes two: the weights' move and the KV cache."""
    return (not huge_pages_disabled() and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and transparent_huge_pages() in ("always", "madvise"))


def zeroed_bytes(nbytes: int) -> torch.Tensor:
    """A zero uint8 tensor of `nbytes` on the CPU whose pages are mapped lazily (RAM is used only as it is
    written). From 2 MiB up it is its own anonymous mapping, starting on a 2 MiB boundary and advised for
    huge pages where they are available, advised against them where KESTREL_DISABLE_HUGE_PAGES=1 (so that
    neither numpy's own advice on large arrays nor the kernel's `always` setting brings them back).
    Smaller ones are calloc'd (numpy), starting on a cache line."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        whole = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
        start = -whole.data_ptr() % 64
        return whole[start:start + nbytes]
    # One huge page more than asked, so that the tensor can start on a huge-page boundary (mmap only
    # aligns to 4 KiB). The tensor holds the mapping: it is unmapped when the last view goes.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        mapping.madvise(mmap.MADV_HUGEPAGE)
    elif huge_pages_disabled():
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def zeroed(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zero CPU tensors of these (shape, dtype)s, each starting on a cache line, all carved from one
    `zeroed_bytes` (so that many small ones, a KV cache's layers, still share huge pages)."""
    sizes = [int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + _to_cache_line(size))
    arena = zeroed_bytes(starts[-1])
    return [arena[start:start + size].view(dtype).view(shape)
            for (shape, dtype), start, size in zip(specs, starts, sizes)]


def _to_cache_line(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def move_to_huge_pages(module: torch.nn.Module) -> int:
    """Move the storage of every CPU parameter and buffer of `module` into one mapping advised for huge
    pages, in the module's order (a decode step then streams it front to back). The tensors keep their
    identity, values, views and sharing (tied weights stay tied): only their memory changes. Returns
    the bytes moved (0 where huge pages are not available)."""
    if not huge_pages_available():
        return 0
    # The tensors by the storage they view (tied weights and views share one).
    sharing: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in (*module.parameters(), *module.buffers()) if t.device.type == "cpu"}.values():
        sharing.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    total = sum(_to_cache_line(views[0].untyped_storage().nbytes()) for views in sharing.values())
    if total == 0:
        return 0
    arena = zeroed_bytes(total)
    offset = 0
    with torch.no_grad():
        # One storage at a time, each old copy freed (and trimmed) as soon as its tensors have moved: the
        # RSS peaks at the weights plus one storage, not twice the weights.
        for views in sharing.values():
            old = views[0].untyped_storage()
            new = arena[offset:offset + old.nbytes()]
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            for t in views:
                t.data = torch.empty(0, dtype=t.dtype).set_(new.untyped_storage(),
                                                            new.storage_offset() // t.element_size()
                                                            + t.storage_offset(), t.shape, t.stride())
            offset += _to_cache_line(old.nbytes())
            del old, new
            return_freed_memory()
    return total


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system. glibc keeps freed heap memory mapped until it is
    trimmed, and a load frees much of it in small pieces between live ones (the old copies of the
    weights as they are packed and moved, the profile forward's activations), which it would keep."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (None under another C library)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
