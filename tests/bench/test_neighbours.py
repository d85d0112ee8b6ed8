"""`kestrel bench latency --neighbour-threads N`: busy neighbours run during each engine's neighbour
round only, the same for every engine, and none outlives it; the report carries the TPOT ratio."""

from __future__ import annotations

import argparse
import time

import psutil
import pytest

from kestrel.bench import latency
from kestrel.bench.neighbours import BusyNeighbours


def new_children(before: set[int]) -> list[int]:
    """This process's children that were not there before (earlier tests of the suite may have left
    helpers of their own running, multiprocessing's resource tracker among them)."""
    return [c.pid for c in psutil.Process().children() if c.pid not in before]


def child_pids() -> set[int]:
    return {c.pid for c in psutil.Process().children()}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_busy_neighbours_spin_and_are_reaped():
    before = child_pids()
    with BusyNeighbours(2) as neighbours:
        pids = neighbours.pids
        assert len(pids) == 2 and all(alive(p) for p in pids)
        procs = [psutil.Process(p) for p in pids]
        time.sleep(0.5)
        assert all(p.cpu_times().user > 0.1 for p in procs)   # they do spin
    assert not any(alive(p) for p in pids)
    assert not new_children(before)


def test_busy_neighbours_are_reaped_when_the_body_fails():
    with pytest.raises(RuntimeError), BusyNeighbours(1) as neighbours:
        pids = neighbours.pids
        raise RuntimeError("round failed")
    assert not any(alive(p) for p in pids)


def test_zero_neighbours_start_nothing():
    before = child_pids()
    with BusyNeighbours(0) as neighbours:
        assert neighbours.pids == [] and not new_children(before)


class FakeServer:
    label = "fake"
    pid = 0
    base_url = "http://unused"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_latency_rounds_run_alone_then_beside_the_neighbours(monkeypatch):
    events: list[tuple[str, str, int]] = []
    before = child_pids()

    def children() -> int:
        return len(new_children(before))

    def fake_start(stack, spec, args):
        return latency.LiveEngine(spec, FakeServer(), None, "m", type("Rss", (), {"peak": 1})())

    def fake_round(engine, requests, output_len):
        beside = children()
        events.append(("round", engine.spec, beside))
        return {"ttft_s": 0.01, "tpot_s": 0.01 * (1 + beside)}   # a neighbour doubles the TPOT

    def fake_settle(engine, args):
        events.append(("settle", engine.spec, children()))

    monkeypatch.setattr(latency, "start_engine", fake_start)
    monkeypatch.setattr(latency, "run_round", fake_round)
    monkeypatch.setattr(latency, "settle", fake_settle)
    args = argparse.Namespace(input_len=8, output_len=4, concurrency=[1], runs=2, neighbour_threads=1, model=None)
    engines = latency.measure_engines(["kestrel", "peer"], args)

    one_round = [("settle", "kestrel", 0), ("round", "kestrel", 0), ("settle", "kestrel", 1), ("round", "kestrel", 1),
                 ("settle", "peer", 0), ("round", "peer", 0), ("settle", "peer", 1), ("round", "peer", 1)]
    assert events == one_round * 2
    assert not new_children(before)   # no neighbour leaked
    for e in engines:
        (s,) = e["settings"]
        assert s["tpot_ms"] == pytest.approx(10) and s["neighbour"]["tpot_ms"] == pytest.approx(20)
        assert s["neighbour_tpot_ratio"] == pytest.approx(2.0)
    report = {"engines": engines, "workload": {"id": "W3", "input_len": 8, "output_len": 4, "concurrency": [1],
                                               "runs": 2, "sampling": "greedy", "neighbour_threads": 1},
              "command": "test", "date": "now", "machine": {"cpu_model": "cpu", "usable_cpus": 2, "bf16_flags": []},
              "load_average_at_start": [0, 0, 0], "load_average_at_end": [0, 0, 0]}
    summary = latency.format_summary(report)
    assert "kestrel +1 busy" in summary and "over alone at 1 concurrent: 2.00x" in summary
    assert "+1 busy" in latency.format_markdown(report)


def test_without_neighbours_no_settling_and_no_neighbour_rows(monkeypatch):
    calls = []
    monkeypatch.setattr(latency, "start_engine",
                        lambda stack, spec, args: latency.LiveEngine(spec, FakeServer(), None, "m",
                                                                     type("Rss", (), {"peak": 1})()))
    monkeypatch.setattr(latency, "run_round", lambda e, r, n: calls.append("round") or {"ttft_s": 1, "tpot_s": 1})
    monkeypatch.setattr(latency, "settle", lambda e, a: calls.append("settle"))
    args = argparse.Namespace(input_len=8, output_len=4, concurrency=[1], runs=1, neighbour_threads=0, model=None)
    (engine,) = latency.measure_engines(["kestrel"], args)
    assert calls == ["round"] and "neighbour" not in engine["settings"][0]
