"""A step that raises reaches the user (issue 17, item 6), as vLLM's engine death does.

Server: the engine core's step N raises (KESTREL_TEST_FAULT_AT_STEP, a test hook read at start-up);
an open stream gets an error event and a waiting non-streaming request a 500 within a second of the
fault, /health and new requests answer 503, and the server exits non-zero for a supervisor to
restart it. Offline: the exception raises from `LLM.generate` with a clear message.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx2 as httpx
import pytest

from kestrel import LLM, SamplingParams
from kestrel.engine.exceptions import EngineDeadError
from tests.support.server_process import Server, assert_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAULT_AT_STEP = 3  # step 1 prefills both requests, step 2 decodes, step 3 raises
FAULT_TIME = re.compile(r"injected fault at step 3 \(KESTREL_TEST_FAULT_AT_STEP\) at t=([0-9.]+)")


def num_waiting(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(r"^kestrel:num_requests_waiting\{[^}]*\} ([0-9.]+)$", text, re.M).group(1))


def test_step_fault_ends_every_request_and_the_server_exits_non_zero():
    server = Server("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--dtype", "float32",
                    env={"KESTREL_TEST_FAULT_AT_STEP": str(FAULT_AT_STEP)}, held=True)
    try:
        server.wait_ready()
        server.hold()  # both requests are queued in the engine core before step 1 runs
        stream_body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
        plain_body = {"prompt": "The capital of France is", "max_tokens": 100, "ignore_eos": True}

        async def stream(c: httpx.AsyncClient) -> list[tuple[float, str]]:
            events = []
            async with c.stream("POST", f"{server.url}/v1/completions", json=stream_body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append((time.time(), line[len("data: "):]))
            return events

        async def plain(c: httpx.AsyncClient) -> tuple[float, httpx.Response]:
            r = await c.post(f"{server.url}/v1/completions", json=plain_body)
            return time.time(), r

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                tasks = asyncio.gather(stream(c), plain(c))
                deadline = time.monotonic() + 60
                while num_waiting(server) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert num_waiting(server) == 2
                server.release()
                return await tasks

        events, (plain_at, plain_response) = asyncio.run(run())

        # The stream had its tokens from steps 1 and 2, then one error event, then [DONE].
        assert events[-1][1] == "[DONE]"
        tokens = [json.loads(e)["choices"][0]["text"] for _, e in events[:-2]]
        assert len(tokens) == FAULT_AT_STEP - 1, events
        error_at, error_event = events[-2]
        error = json.loads(error_event)["error"]
        assert error["code"] == 500 and error["type"] == "InternalServerError", error
        fault_at = float(FAULT_TIME.search(error["message"]).group(1))
        assert "InjectedFault" in error["message"]
        # The waiting non-streaming request: a 500 in OpenAI's shape, with the same cause.
        body = assert_error(plain_response, 500, "InternalServerError", "injected fault at step 3")
        assert body["code"] == 500
        assert error_at - fault_at < 1.0 and plain_at - fault_at < 1.0, (error_at - fault_at, plain_at - fault_at)

        # Until it exits, the server says it is down and turns new requests away ...
        assert_error(httpx.get(f"{server.url}/health"), 503, "ServiceUnavailableError", "injected fault")
        assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                     503, "ServiceUnavailableError")
        # ... then exits non-zero, for a supervisor to restart it.
        assert server.proc.wait(timeout=30) == 1, server.output()
        log = server.output()
        assert "engine core: a step failed" in log and "Traceback" in log  # the cause, for the operator
    finally:
        server.stop()


def test_offline_step_fault_raises_with_a_clear_message(monkeypatch):
    llm = LLM(max_model_len=128, kv_cache_memory=32 << 20, dtype="float32")
    executor = llm.llm_engine.engine_core.executor
    execute_model = executor.execute_model
    calls = []

    def failing_execute_model(scheduler_output):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return execute_model(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", failing_execute_model)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="the engine failed in a step: RuntimeError: device lost") as info:
        llm.generate(["Hello there", "Once upon a time"], params, use_tqdm=False)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine's state after a failed step is not trusted: it refuses more work, saying why.
    with pytest.raises(EngineDeadError, match="device lost; create a new engine"):
        llm.generate("Hello", params, use_tqdm=False)
