"""The benchmarks' HTTP client for OpenAI-compatible servers (Kestrel's, llama.cpp's, vLLM's): requests
sent at given offsets through one httpx client, each timed (TTFT, inter-token gaps, end to end) from a
streamed or plain `POST /completions`. `kestrel bench serve` (serve.py) documents the measures; the
latency and throughput benchmarks and serve_compare.py drive their servers through the same code."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from kestrel.bench.common import log
from kestrel.bench.workloads import BenchRequest

DEFAULT_TIMEOUT_S = 600.0


def make_client(target: Target) -> Any:
    """A plain HTTP client (httpx, which the openai package is built on) that reads the SSE stream
    itself: the openai client's per-chunk object building costs more CPU than the server's side of a
    stream, which on a 2-core machine is taken from the engine under test."""
    import httpx2 as httpx

    return httpx.AsyncClient(base_url=target.base_url.rstrip("/") + "/", timeout=target.timeout,
                             headers={"Authorization": f"Bearer {target.api_key}"},
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


class ServerError(RuntimeError):
    def __init__(self, status_code: int, body: str) -> None:
        super().__init__(body.strip()[:300] or f"HTTP {status_code}")
        self.status_code = status_code


async def resolve_model(target: Target, model: str | None = None) -> tuple[str, list[str]]:
    """`model`, else the first id from GET /models; if that fails the run still goes on (its
    requests will fail and be counted), under a placeholder name."""
    if model:
        return model, []
    try:
        async with make_client(target) as client:
            response = await asyncio.wait_for(client.get("models"), timeout=min(target.timeout, 30.0))
            if response.status_code != 200:
                raise ServerError(response.status_code, response.text)
            ids = [m["id"] for m in response.json().get("data", [])]
        if ids:
            return ids[0], []
        note = "GET /models listed no model"
    except Exception as e:  # noqa: BLE001 — any failure to reach the server
        note = f"GET /models failed: {describe_error(e)}"
    log(f"warning: {note}; sending model 'default'")
    return "default", [note]


@dataclass
class RequestResult:
    input_len: int
    requested_output_len: int
    ok: bool = False
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    usage_reported: bool = False
    error: str | None = None
    send_offset_s: float = 0.0   # when it was actually sent, from the start of the run

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def describe_error(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    status = getattr(e, "status_code", None)
    text = str(e) or type(e).__name__
    return f"{type(e).__name__} ({status}): {text}" if status else f"{type(e).__name__}: {text}"


@dataclass(frozen=True)
class Target:
    """Where and how to send: the server and what every request body carries."""
    base_url: str
    api_key: str = "unused"
    timeout: float = DEFAULT_TIMEOUT_S
    stream: bool = True                     # False: one JSON response per request (no TTFT/ITL)
    extra_body: dict[str, Any] = field(default_factory=dict)   # e.g. llama.cpp's cache_prompt


async def send_requests(target: Target, model: str, requests: list[BenchRequest], arrivals: list[float],
                        max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival offset (s); every request's result and the run's wall time
    (first send to last finish)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_client(target) as client:
        start = time.perf_counter()

        async def one(request: BenchRequest, at: float) -> RequestResult:
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                return await timed_request(client, target, model, request, start)
            async with limit:
                return await timed_request(client, target, model, request, start)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, arrivals)))
        wall_s = time.perf_counter() - start
    return list(results), wall_s


async def timed_request(client: Any, target: Target, model: str, request: BenchRequest,
                        run_start: float) -> RequestResult:
    result = RequestResult(request.input_len, request.output_len)
    sent = time.perf_counter()
    result.send_offset_s = sent - run_start
    send = stream_one if target.stream else complete_one
    try:
        await asyncio.wait_for(send(client, target, model, request, sent, result), timeout=target.timeout)
        result.e2e_s = time.perf_counter() - sent
        result.ok = True
    except Exception as e:  # noqa: BLE001 — every failure is counted, none stops the run
        result.error = describe_error(e)
        result.ok = False
    return result


def request_body(target: Target, model: str, request: BenchRequest) -> dict[str, Any]:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": target.stream, **target.extra_body}
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def complete_one(client: Any, target: Target, model: str, request: BenchRequest, sent: float,
                       result: RequestResult) -> None:
    response = await client.post("completions", json=request_body(target, model, request))
    if response.status_code != 200:
        raise ServerError(response.status_code, response.text)
    usage = response.json().get("usage") or {}
    if usage.get("completion_tokens") is None:
        raise RuntimeError("the response has no usage.completion_tokens")
    result.output_tokens = int(usage["completion_tokens"])
    result.usage_reported = True


async def stream_one(client: Any, target: Target, model: str, request: BenchRequest, sent: float,
                     result: RequestResult) -> None:
    last = None
    chunks = 0
    async with client.stream("POST", "completions", json=request_body(target, model, request)) as response:
        if response.status_code != 200:
            raise ServerError(response.status_code, (await response.aread()).decode(errors="replace"))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event in the stream: {chunk['error']}")
            now = time.perf_counter()
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                chunks += 1
                if last is None:
                    result.ttft_s = now - sent
                else:
                    result.itl_s.append(now - last)
                last = now
            usage = chunk.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
                result.usage_reported = True
    if not result.usage_reported:
        result.output_tokens = chunks
    if result.ttft_s is None:
        raise RuntimeError("the stream ended without any text")


def reset_prefix_cache(base_url: str) -> None:
    """POST /reset_prefix_cache on a Kestrel server (base_url ends in /v1)."""
    import urllib.request
    root = base_url.removesuffix("/").removesuffix("/v1")
    urllib.request.urlopen(urllib.request.Request(f"{root}/reset_prefix_cache", method="POST"), timeout=30).close()
