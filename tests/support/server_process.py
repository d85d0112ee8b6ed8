"""A real `kestrel serve` process on a free port, for the end-to-end server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

STARTUP_TIMEOUT_S = 180
# Read by the engine core at start-up (kestrel/core/core_process.py): no step runs while this file exists.
HOLD_FILE_ENV = "KESTREL_TEST_HOLD_FILE"


def chat_capital_of_france(server: Server) -> dict:
    """The design doc's chat question, greedy, 32 tokens; the (asserted 200) response's first choice."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`held=True` gives the engine core a hold file: `hold()` stops its stepping (requests are
    admitted and queued, none gets an output) until `release()`, whatever the machine's speed."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, held: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.expected_returncode = 0
        self.hold_file = os.path.join(tempfile.mkdtemp(prefix="kestrel-test-"), "hold") if held else None
        extra = {HOLD_FILE_ENV: self.hold_file} if held else {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kestrel.entrypoints.cli", "serve", "--port", str(self.port), *flags],
            env={**os.environ, "HF_HUB_OFFLINE": "1", **extra, **(env or {})},
            stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def hold(self) -> None:
        assert self.hold_file is not None, "start the server with held=True"
        open(self.hold_file, "w").close()

    def release(self) -> None:
        if self.hold_file is not None and os.path.exists(self.hold_file):
            os.unlink(self.hold_file)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become healthy in time")

    def stop(self) -> None:
        self.release()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.log.close()


def assert_error(response: httpx.Response, status: int, type_: str, *fragments: str) -> dict:
    """`response` is an OpenAI-shaped error with this status and type, its message holding `fragments`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == type_
    for fragment in fragments:
        assert fragment in body["error"]["message"], body
    return body["error"]
