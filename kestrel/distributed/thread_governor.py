"""How many threads a CPU worker's intra-op pool (torch's, which the C++ kernels' at::parallel_for
follows too) runs with: sized at start from the cores the process can really use, then shrunk while
busy neighbours take some of them and grown back when they leave.

Why: the pool's threads meet at a barrier after every parallel op. When another process takes one of
the pool's cores, the thread on it is descheduled for whole scheduler slices and every barrier waits
for it: on 2 cores one busy neighbour thread made a decode step ~50x slower, where giving up the
contended core costs ~2x.

    usable cores   = affinity mask, capped by the cgroup CPU quota (floor(quota / period), at least 1)
    pool at start  = usable cores, less one left to the API server and engine core with >= 4 of them
    while running  = every CHECK_INTERVAL_S, between steps: the cores neighbours took over the last
                     interval = busy CPU time of the watched cores (/proc/stat) less the CPU time of
                     Kestrel's own processes (this one and its ancestors up to the front end); the
                     pool shrinks at once when they crowd it and grows back only after GROW_CHECKS
                     calm checks in a row (hysteresis, so a bursty neighbour does not flap it)

`ThreadGovernor` is the one component that decides; `governor_for_worker` builds it for a worker.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kestrel import envs

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
FRONTEND_PID_ENV = "KESTREL_FRONTEND_PID"  # set by the process that starts the engine; inherited
MIN_CORES_TO_RESERVE = 4      # with this many usable cores, one is left out of the pool (as vLLM's CPU backend)
CHECK_INTERVAL_S = 0.5        # a step is ~15 ms: the check (~0.1 ms) runs on a few steps a second
STALE_WINDOW_S = 2.0          # a longer window spans an idle gap (other engines' work, old neighbours)
SHRINK_MARGIN = 0.5           # shrink when the free cores fall this far below the pool
# Grow when a whole core more, less this, is free (a little background work, softirqs and the
# clients of a server on the same machine, must not hold the pool down) ...
GROW_MARGIN = 0.4
GROW_CHECKS = 2               # ... in this many checks in a row
MAX_ANCESTORS = 4             # worker -> engine core -> API server is the deepest Kestrel chain
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (steal: cores the host took)


# ---- cores at start -----------------------------------------------------------------------------

def cgroup_cpu_limit(root: Path = CGROUP_ROOT, self_cgroup: str | None = None) -> float | None:
    """The cores the process's cgroup CPU quota allows (quota / period): the tightest along its cgroup
    path (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us); None when there is no quota.
    `self_cgroup`: the text of /proc/self/cgroup (read when None)."""
    if self_cgroup is None:
        try:
            self_cgroup = (PROC / "self" / "cgroup").read_text()
        except OSError:
            self_cgroup = ""
    limits = [limit for folder in _cgroup_folders(root, self_cgroup) if (limit := _quota_of(folder)) is not None]
    return min(limits, default=None)


def _cgroup_folders(root: Path, self_cgroup: str) -> list[Path]:
    """The cgroup folders whose CPU quota applies to this process: its own and each parent up to the
    hierarchy's mount, v2 (controllers "") and v1's cpu controller. Inside a container the path may
    not exist under the mount (the mount is the container's own cgroup): then the mount alone."""
    folders: list[Path] = []
    for line in self_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base = root
        elif "cpu" in controllers.split(","):
            base = root / controllers
        else:
            continue
        folder = base / path.strip().lstrip("/")
        if not folder.is_dir():
            folder = base
        while True:
            folders.append(folder)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return folders


def _quota_of(folder: Path) -> float | None:
    try:
        if (folder / "cpu.max").is_file():
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (folder / "cpu.cfs_quota_us").is_file():
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            period_us = int((folder / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None


def usable_cores(affinity: int, cpu_limit: float | None) -> int:
    """Cores the process can really use: its affinity mask, capped by the quota's whole cores (>= 1)."""
    if cpu_limit is None:
        return max(1, affinity)
    return max(1, min(affinity, math.floor(cpu_limit)))


def pool_size_at_start(usable: int, leave_one_to_frontend: bool) -> int:
    """With enough cores, one stays out of the pool for the API server and engine core; not on fewer
    than MIN_CORES_TO_RESERVE, where a core out of two or three costs the pool too much."""
    return usable - 1 if leave_one_to_frontend and usable >= MIN_CORES_TO_RESERVE else usable


# ---- what the cores were busy with --------------------------------------------------------------

@dataclass(frozen=True)
class CpuReading:
    """One sample of the counters the governor compares (seconds)."""
    time: float        # monotonic clock
    busy: float        # busy CPU time of the watched cores, every process on them
    own: float         # CPU time of Kestrel's own processes


def busy_seconds(proc_stat: str, cpus: Sequence[int], ticks_per_s: float) -> float:
    """Busy time of `cpus` in /proc/stat's text: user, nice, system, irq, softirq and steal ticks."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
    return ticks / ticks_per_s


def process_cpu_seconds(pid: int, proc: Path = PROC, ticks_per_s: float | None = None) -> float:
    """utime + stime of a process (all its threads), seconds; 0 if it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / (ticks_per_s or _ticks_per_s())


def parent_pid(pid: int, proc: Path = PROC) -> int | None:
    try:
        return int((proc / str(pid) / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def kestrel_pids(own: int, frontend: int | None, proc: Path = PROC) -> list[int]:
    """This process and its ancestors up to the front end (the engine core and API server of `kestrel
    serve`); this process alone when the front end is not among its nearest ancestors."""
    chain = [own]
    while frontend is not None and chain[-1] != frontend and len(chain) <= MAX_ANCESTORS:
        parent = parent_pid(chain[-1], proc)
        if parent is None or parent <= 1:
            return [own]
        chain.append(parent)
    return chain if frontend is None or chain[-1] == frontend else [own]


def mark_frontend() -> None:
    """Called by a process that starts an engine: it, and what it spawns, count as Kestrel's own unless
    an outer Kestrel process has marked itself first."""
    os.environ.setdefault(FRONTEND_PID_ENV, str(os.getpid()))


def frontend_pid() -> int | None:
    return envs.KESTREL_FRONTEND_PID


def _ticks_per_s() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


class ProcCpuSampler:
    """Reads /proc: the watched cores' busy time and the CPU time of `pids`."""

    def __init__(self, cpus: Sequence[int], pids: Sequence[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.cpus = tuple(cpus)
        self.pids = tuple(pids)
        self.clock = clock
        self.ticks_per_s = _ticks_per_s()

    def __call__(self) -> CpuReading:
        with open(PROC / "stat") as f:
            stat = f.read()
        own = sum(process_cpu_seconds(pid, ticks_per_s=self.ticks_per_s) for pid in self.pids)
        return CpuReading(self.clock(), busy_seconds(stat, self.cpus, self.ticks_per_s), own)


# ---- the decision -------------------------------------------------------------------------------

def neighbour_cores(before: CpuReading, after: CpuReading) -> float:
    """Cores other processes kept busy between two readings (never below 0)."""
    wall = after.time - before.time
    if wall <= 0:
        return 0.0
    return max(0.0, ((after.busy - before.busy) - (after.own - before.own)) / wall)


class ThreadCountPolicy:
    """The pool size for the cores neighbours take, with hysteresis: shrink as soon as the free cores
    fall SHRINK_MARGIN below the pool, grow only after GROW_CHECKS checks in a row with a core more free."""

    def __init__(self, max_threads: int, usable: int) -> None:
        if not 1 <= max_threads <= usable:
            raise ValueError(f"a pool of {max_threads} threads on {usable} usable cores")
        self.max_threads = max_threads
        self.usable = usable
        self.calm_checks = 0

    def next_count(self, current: int, neighbours: float) -> int:
        # The core left out for the front end absorbs a neighbour before the pool has to give one up.
        free = min(float(self.max_threads), self.usable - neighbours)
        if free < current - SHRINK_MARGIN:
            self.calm_checks = 0
            return max(1, math.floor(free + 0.5))
        if current < self.max_threads and free >= current + 1 - GROW_MARGIN:
            self.calm_checks += 1
            if self.calm_checks >= GROW_CHECKS:
                self.calm_checks = 0
                return min(self.max_threads, math.floor(free + GROW_MARGIN))
            return current
        self.calm_checks = 0
        return current


class ThreadGovernor:
    """The worker's thread count. `between_steps()` is called by the worker before each step, on the
    thread that runs the steps (torch's pool size is per calling thread under OpenMP); it costs a clock
    read except every CHECK_INTERVAL_S, when it samples the CPU counters and may resize the pool.
    `sampler` None: the count is pinned (no checks)."""

    def __init__(self, threads: int, policy: ThreadCountPolicy | None, sampler: Callable[[], CpuReading] | None,
                 set_threads: Callable[[int], None], clock: Callable[[], float] = time.monotonic,
                 interval_s: float = CHECK_INTERVAL_S) -> None:
        self.threads = threads
        self.policy = policy
        self.sampler = sampler if policy is not None else None
        self.set_threads = set_threads
        self.clock = clock
        self.interval_s = interval_s
        self.last: CpuReading | None = None
        self.next_check = 0.0
        self.resizes = 0
        set_threads(threads)

    @property
    def adaptive(self) -> bool:
        return self.sampler is not None

    def describe(self) -> str:
        if not self.adaptive:
            return f"{self.threads} threads (pinned)"
        assert self.policy is not None
        return (f"{self.threads} threads (adaptive, at most {self.policy.max_threads} of "
                f"{self.policy.usable} usable cores)")

    def between_steps(self) -> int:
        """The pool size for the next step, resized first if a check is due and says so."""
        if self.sampler is None or self.clock() < self.next_check:
            return self.threads
        reading = self.sampler()
        self.next_check = reading.time + self.interval_s
        last, self.last = self.last, reading
        if last is None or reading.time - last.time > STALE_WINDOW_S:
            return self.threads  # a fresh baseline: the window since the last check spans an idle gap
        assert self.policy is not None
        neighbours = neighbour_cores(last, reading)
        wanted = self.policy.next_count(self.threads, neighbours)
        if wanted != self.threads:
            logger.info("thread pool %d -> %d (neighbours kept %.2f cores busy)", self.threads, wanted, neighbours)
            self.threads = wanted
            self.resizes += 1
            self.set_threads(wanted)
        return self.threads


def governor_for_worker(pinned_threads: int | None, leave_one_to_frontend: bool,
                        set_threads: Callable[[int], None], cgroup_root: Path = CGROUP_ROOT) -> ThreadGovernor:
    """A worker's governor over the cores this process is pinned to: pinned at `pinned_threads` when
    given, else adaptive. `leave_one_to_frontend`: this worker's cores are all the machine gives
    Kestrel (one worker), so one of them is left to the API server and engine core when there are enough."""
    cpus = sorted(os.sched_getaffinity(0))
    if pinned_threads is not None:
        return ThreadGovernor(pinned_threads, None, None, set_threads)
    usable = usable_cores(len(cpus), cgroup_cpu_limit(cgroup_root))
    threads = pool_size_at_start(usable, leave_one_to_frontend)
    sampler = ProcCpuSampler(cpus, kestrel_pids(os.getpid(), frontend_pid()))
    return ThreadGovernor(threads, ThreadCountPolicy(threads, usable), sampler, set_threads)
