"""Per-request traces: every box's timed events for a request, on one clock, in the front end.

The API server records its own events (received, tokenized, sent to an engine core, first output,
finished, last byte sent); the engine core's (queued, scheduled with its prefix-cache hits, resumed,
preempted, one `step` per step with the batch and the step's time split, finished) arrive with the
request's outputs. All are `time.monotonic()` readings, one clock for every process on the machine.

`TraceStore` keeps the last N requests' traces (a ring: the oldest is dropped); `RequestTrace.to_dict`
is what `GET /v1/requests/{id}/trace` returns: the events, relative to the request's arrival, and the
time spent in each box, which answers "why was this request slow?":

    api_server      tokenizing, then turning outputs into text and sending them (the rest of the time)
    scheduler       waiting in the queue (first admission and after preemptions) and planning steps
    model_runner    building inputs and the forward passes of the steps the request was in
    sampler         logits, sampling, verifying drafts
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kestrel.messages import TraceEvent

API_SERVER, ENGINE_CORE = "api_server", "engine_core"


@dataclass
class RequestTrace:
    request_id: str
    events: list[tuple[str, str, float, dict[str, Any]]] = field(default_factory=list)  # (box, name, t, attrs)

    def add(self, box: str, name: str, at: float | None = None, **attrs: Any) -> None:
        self.events.append((box, name, time.monotonic() if at is None else at, attrs))

    def add_engine_events(self, events: list[TraceEvent], engine: int) -> None:
        for event in events:
            self.events.append((ENGINE_CORE, event.name, event.time, {**event.attrs, "engine": engine}))

    def has(self, name: str) -> bool:
        return any(e[1] == name for e in self.events)

    def to_dict(self) -> dict[str, Any]:
        events = sorted(self.events, key=lambda e: e[2])
        start = next((t for _, name, t, _ in events if name == "received"), events[0][2] if events else 0.0)
        return {
            "request_id": self.request_id,
            "events": [{"box": box, "name": name, "t_ms": round((t - start) * 1e3, 3), **attrs}
                       for box, name, t, attrs in events],
            "boxes_ms": self.time_in_boxes(),
            "summary": self.summary(),
        }

    def _times(self, name: str) -> list[float]:
        return [t for _, n, t, _ in self.events if n == name]

    def _first(self, name: str) -> float | None:
        times = self._times(name)
        return min(times) if times else None

    def time_in_boxes(self) -> dict[str, float]:
        """Milliseconds per box (see the module docstring); they add up to the request's time from
        arrival to its last byte, the engine core's own bookkeeping being what is left."""
        received, end = self._first("received"), self._last_time()
        if received is None or end is None:
            return {}
        steps = [a for _, n, _, a in self.events if n == "step"]
        runner = sum(a.get("prepare_ms", 0.0) + a.get("forward_ms", 0.0) for a in steps)
        sampler = sum(a.get("sample_ms", 0.0) for a in steps)
        planning = sum(a.get("schedule_ms", 0.0) for a in steps)
        waiting = self._waiting_s() * 1e3
        tokenized = self._first("tokenized")
        queued = self._first("queued")
        finished = self._first("finished")
        front = ((tokenized - received) if tokenized is not None else 0.0) * 1e3
        if queued is not None and tokenized is not None:
            front += (queued - tokenized) * 1e3  # handing over to the engine core
        if finished is not None:
            front += (end - finished) * 1e3       # the last outputs' text and bytes
        total = (end - received) * 1e3
        boxes = {"api_server": front, "scheduler": waiting + planning, "model_runner": runner, "sampler": sampler}
        boxes["engine_core_other"] = max(0.0, total - sum(boxes.values()))
        return {k: round(v, 3) for k, v in boxes.items()}

    def _waiting_s(self) -> float:
        """Time queued before each admission: queued → scheduled, and each preempted → resumed."""
        waited, since = 0.0, None
        for _, name, t, _ in sorted(self.events, key=lambda e: e[2]):
            if name in ("queued", "preempted"):
                since = t
            elif name in ("scheduled", "resumed") and since is not None:
                waited += t - since
                since = None
        return waited

    def _last_time(self) -> float | None:
        return max((t for _, _, t, _ in self.events), default=None)

    def summary(self) -> dict[str, Any]:
        received = self._first("received")
        first_token, finished = self._first("first_token"), self._first("finished")
        steps = [a for _, n, _, a in self.events if n == "step"]
        return {
            "ttft_ms": round((first_token - received) * 1e3, 3) if None not in (first_token, received) else None,
            "e2e_ms": round((self._last_time() - received) * 1e3, 3) if received is not None else None,
            "queue_ms": round(self._waiting_s() * 1e3, 3),
            "steps": len(steps),
            "prefill_chunks": sum(1 for a in steps if a.get("tokens", 1) > 1 + a.get("drafts", 0)),
            "preemptions": len(self._times("preempted")),
            "finished": finished is not None,
        }


class TraceStore:
    """The last `capacity` requests' traces, by request id (the oldest dropped first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a trace store holds at least one request, got {capacity}")
        self.capacity = capacity
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()

    def start(self, request_id: str) -> RequestTrace:
        trace = RequestTrace(request_id)
        self._traces[request_id] = trace
        self._traces.move_to_end(request_id)
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)
        return trace

    def get(self, request_id: str) -> RequestTrace | None:
        return self._traces.get(request_id)

    def find(self, response_id: str) -> list[RequestTrace]:
        """The traces of an OpenAI response id: the request itself, or, for a completion with several
        prompts, its requests `{id}-0`, `{id}-1`, ..."""
        if response_id in self._traces:
            return [self._traces[response_id]]
        prefix = response_id + "-"
        return [t for rid, t in self._traces.items() if rid.startswith(prefix) and rid[len(prefix):].isdigit()]

    def recent(self, limit: int) -> list[RequestTrace]:
        """The last `limit` requests' traces, newest first."""
        newest = reversed(self._traces.values())
        return [trace for trace, _ in zip(newest, range(max(limit, 0)))]

    def __len__(self) -> int:
        return len(self._traces)
