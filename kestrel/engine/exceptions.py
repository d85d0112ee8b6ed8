"""Why a request could not be served by the engine (as vLLM's `vllm/v1/engine/exceptions.py`).

The API server turns them into HTTP answers: `EngineDeadError` into 500 for the requests it ends
(and 503 for later ones, while the server exits), `EngineStoppedError` into 503.
"""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core failed in a step, or its process died: every request it held ends with this,
    and the engine serves no more."""


class EngineStoppedError(RuntimeError):
    """The engine was told to stop (the server is shutting down): its open requests end with this."""
