"""A worker process that dies under a `-tp 2` server (issue 18): every in-flight request ends with an
error within a second, /health says 503, the server exits non-zero, and no process is left behind."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx2 as httpx
import psutil
import pytest
from parity import save_tiny_llama
from server_process import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _spawned_children(proc: psutil.Process) -> list[psutil.Process]:
    """multiprocessing's spawned children of `proc` (not its resource tracker)."""
    return [c for c in proc.children() if "spawn_main" in " ".join(c.cmdline())]


def test_a_killed_worker_ends_every_request_with_an_error_within_a_second(tmp_path):
    save_tiny_llama(tmp_path)
    server = Server("--model", str(tmp_path), "-tp", "2", "--dtype", "float32", "--max-model-len", "512",
                    "--kv-cache-memory", "16MiB")
    try:
        server.wait_ready()
        front = psutil.Process(server.proc.pid)
        (engine_core,) = _spawned_children(front)
        workers = _spawned_children(engine_core)
        assert len(workers) == 2, workers
        tree = [front, engine_core, *workers]
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}

        async def stream(c: httpx.AsyncClient, started: asyncio.Event) -> list[tuple[float, str]]:
            events = []
            async with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append((time.time(), line[len("data: "):]))
                        started.set()
            return events

        async def run() -> tuple[float, list]:
            async with httpx.AsyncClient(timeout=60) as c:
                started = [asyncio.Event() for _ in range(3)]
                tasks = asyncio.gather(*(stream(c, e) for e in started))
                for e in started:
                    await asyncio.wait_for(e.wait(), 60)
                killed_at = time.time()
                workers[1].send_signal(signal.SIGKILL)
                return killed_at, await tasks

        killed_at, streams = asyncio.run(run())
        for events in streams:
            assert events[-1][1] == "[DONE]"
            error_at, last = events[-2]
            error = json.loads(last)["error"]
            assert error["code"] == 500 and "worker rank 1" in error["message"], error
            assert error_at - killed_at < 1.0, error_at - killed_at
            assert len(events) < 480  # ended early, not run to max_tokens
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 or server.proc.poll() is not None
        assert server.proc.wait(timeout=30) == 1, server.output()
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, f"left behind: {alive}"
    finally:
        server.stop()
