"""Which data-parallel engine core gets a request, as vLLM's DP load balancer chooses: the core with
the least load, and the core that owns a request is remembered until the request ends there.

A core's load is what it last reported (`SchedulerStats`: waiting, then running) plus the requests
the front end has sent it since that report, counted as waiting: a burst that arrives between two
reports spreads over the cores instead of piling onto the one that looked idle. Ties go to the core
that has been given the fewest requests so far, so that a trickle of requests spreads too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kestrel.messages import SchedulerStats


@dataclass
class CoreLoad:
    waiting: int = 0           # as last reported
    running: int = 0           # as last reported
    sent_since_report: int = 0
    assigned_total: int = 0

    def key(self) -> tuple[int, int, int]:
        return self.waiting + self.sent_since_report, self.running, self.assigned_total


class LeastLoadedRouter:
    def __init__(self, num_cores: int) -> None:
        if num_cores < 1:
            raise ValueError(f"a router needs at least one engine core, got {num_cores}")
        self.loads = [CoreLoad() for _ in range(num_cores)]
        self._owner: dict[str, int] = {}  # engine-core request id -> core index

    def choose(self) -> int:
        return min(range(len(self.loads)), key=lambda i: self.loads[i].key())

    def assign(self, request_ids: list[str]) -> int:
        """Pick the least-loaded core for these engine-core requests (the samples of one user request
        travel together) and remember it as their owner; returns the core's index."""
        core = self.choose()
        load = self.loads[core]
        load.sent_since_report += len(request_ids)
        load.assigned_total += len(request_ids)
        for request_id in request_ids:
            self._owner[request_id] = core
        return core

    def record_stats(self, core: int, stats: SchedulerStats) -> None:
        """The core's own report replaces the estimate: it counts every request it has received."""
        load = self.loads[core]
        load.waiting, load.running = stats.num_waiting_reqs, stats.num_running_reqs
        load.sent_since_report = 0

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def release(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget these requests' owners (finished or aborted); returns those that had one, by core."""
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self._owner.pop(request_id, None)
            if core is not None:
                by_core.setdefault(core, []).append(request_id)
        return by_core

    @property
    def num_owned(self) -> int:
        return len(self._owner)
