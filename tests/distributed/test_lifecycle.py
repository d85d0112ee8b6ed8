"""Process lifecycle helpers shared by `kestrel serve`, the engine core and the workers."""

import gc
import weakref

from kestrel.distributed.lifecycle import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_startup_heap_collects_then_freezes_what_survives() -> None:
    garbage = _Node()
    dead = weakref.ref(garbage)
    del garbage
    kept = _Node()
    try:
        freeze_startup_heap()
        assert dead() is None  # start-up's garbage was collected, not frozen with the rest
        assert gc.get_freeze_count() > 0
        # What survived is out of every collection's reach: dropping it frees nothing until unfrozen.
        alive = weakref.ref(kept)
        del kept
        gc.collect()
        assert alive() is not None
    finally:
        gc.unfreeze()
        gc.collect()
    assert alive() is None
