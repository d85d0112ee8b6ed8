"""Busy neighbours for the benchmarks: processes that spin on a core each (as `yes > /dev/null`
does) while a measurement runs, to see how an engine copes with other work on its cores."""

from __future__ import annotations

import subprocess
import sys
import time
from types import TracebackType

SPIN = "while True: pass"
STOP_TIMEOUT_S = 5.0


class BusyNeighbours:
    """`count` busy-spinning processes (one thread each) while in use, as a context manager; they are
    killed and reaped on exit, whatever happened inside. `count` 0: nothing runs."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"a neighbour count must be >= 0, got {count}")
        self.count = count
        self.processes: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def __enter__(self) -> BusyNeighbours:
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-I", "-S", "-c", SPIN],
                                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.processes:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.processes = []
