"""`kestrel serve` with several workers, as the README tells a newcomer to start it (issue 18): each
answers the design doc's chat question on the default model (float32, so that the answer is the
exact one the single-worker parity test expects)."""

from __future__ import annotations

import pytest

from tests.support.server_process import Server, chat_capital_of_france

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


# Pipeline stages behind a server run the same executor and engine-core code as tensor ranks; they are
# tested offline (test_parallel_workers, test_tp_model), which saves a server start here.
@pytest.mark.parametrize("flags", [
    ("-tp", "2"),
    ("-tp", "2", "--distributed-executor-backend", "ray"),
], ids=["tp2-mp", "tp2-ray"])
def test_a_parallel_server_answers_a_chat_request(flags):
    server = Server(*flags, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        server.wait_ready()
        choice = chat_capital_of_france(server)
        assert choice["message"]["content"] == "The capital of France is Paris.", choice
        assert choice["finish_reason"] == "stop"
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.output()
