"""Streaming clients for the load and fault tests: what each client saw of its streamed completion,
many clients looping requests against a server, and the figures of a run."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx2 as httpx

# Long enough for a request queued behind 256 others on 2 CPU cores.
CLIENT_TIMEOUT_S = 300
# Every fifth client hangs up mid-stream on each of its requests.
HANG_UP_EVERY = 5


@dataclass
class Stream:
    """One streamed /v1/completions request as its client saw it. Times are time.monotonic()."""

    prompt: int                     # the index of its body in the run's bodies
    hang_up_after: int | None       # text chunks read before the client closes the connection; None: to the end
    sent_at: float
    status: int = 0
    chunk_times: list[float] = field(default_factory=list)  # each chunk that carried text
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    error: dict | None = None       # an error event, or the body of a non-200 answer
    error_at: float | None = None
    completion_tokens: int | None = None  # from the usage chunk
    events_after_done: int = 0
    done: bool = False              # the stream's last event was [DONE]
    exception: str | None = None    # the client's connection failed (reset, timeout)

    @property
    def hung_up(self) -> bool:
        return self.hang_up_after is not None

    @property
    def completed(self) -> bool:
        """Read to its end: every such stream must be whole."""
        return not self.hung_up and self.status == 200 and self.exception is None

    def read(self, data: str, now: float) -> None:
        if self.done:
            self.events_after_done += 1
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            self.error, self.error_at = event["error"], now
            return
        if event.get("usage"):
            self.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"]:
            if choice["text"]:
                self.text += choice["text"]
                self.chunk_times.append(now)
            if choice["finish_reason"] is not None:
                self.finish_reasons.append(choice["finish_reason"])


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, prompt: int = 0,
                            hang_up_after: int | None = None, first_chunk: asyncio.Event | None = None) -> Stream:
    """POST `body` (streamed) and read the events, closing the connection after `hang_up_after` text
    chunks when given (0: as soon as the headers arrive). `first_chunk` is set once text arrives."""
    stream = Stream(prompt, hang_up_after, time.monotonic())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            stream.status = r.status_code
            if r.status_code != 200:
                stream.error = json.loads(await r.aread()).get("error")
                return stream
            async for line in r.aiter_lines():
                if stream.hang_up_after is not None and len(stream.chunk_times) >= stream.hang_up_after:
                    return stream
                if line.startswith("data: "):
                    stream.read(line[len("data: "):], time.monotonic())
                    if first_chunk is not None and stream.chunk_times:
                        first_chunk.set()
    except httpx.HTTPError as e:
        stream.exception = f"{type(e).__name__}: {e}"
    return stream


def unlimited_client() -> httpx.AsyncClient:
    """One connection per open stream, however many (httpx's default pool holds 100)."""
    return httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_clients(url: str, bodies: list[dict], clients: int, seconds: float) -> tuple[list[Stream], float]:
    """`clients` clients, each sending streamed requests one after another until `seconds` have
    passed (the last one runs to its end); client i starts at body i and takes the next each time.
    Every HANG_UP_EVERY-th client hangs up on each request, after 0, 1, 2, then 3 chunks, in turn.
    Returns every request's stream and the seconds until the last one ended."""
    start = time.monotonic()
    deadline = start + seconds

    async def client_loop(c: httpx.AsyncClient, index: int) -> list[Stream]:
        streams = []
        while time.monotonic() < deadline:
            prompt = (index + len(streams)) % len(bodies)
            hang_up_after = len(streams) % 4 if index % HANG_UP_EVERY == 0 else None
            streams.append(await stream_completion(c, url, bodies[prompt], prompt, hang_up_after))
        return streams

    async with unlimited_client() as c:
        per_client = await asyncio.gather(*(client_loop(c, i) for i in range(clients)))
    return [s for streams in per_client for s in streams], time.monotonic() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def figures(streams: list[Stream], seconds: float, clients: int) -> dict[str, float | int]:
    """The run's figures: requests by outcome, completed requests' output tokens per second, and
    time to first token and inter-chunk latency over completed requests (ms)."""
    completed = [s for s in streams if s.completed]
    ttft = [(s.chunk_times[0] - s.sent_at) * 1e3 for s in completed if s.chunk_times]
    itl = [(b - a) * 1e3 for s in completed for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    tokens = sum(s.completion_tokens or 0 for s in completed)
    return {
        "clients": clients, "seconds": seconds, "requests": len(streams), "completed": len(completed),
        "hung_up": sum(s.hung_up for s in streams), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "itl_p50_ms": round(percentile(itl, 50), 1), "itl_p99_ms": round(percentile(itl, 99), 1),
    }
