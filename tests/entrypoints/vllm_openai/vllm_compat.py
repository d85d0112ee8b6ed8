"""vLLM's `tests.utils.RemoteOpenAIServer`, over Kestrel's `server_process.Server` (a real
`kestrel serve` process on a free port), for the ported tests."""

from __future__ import annotations

import openai

from tests.support.server_process import Server

# The default (embedded) model, as the server calls it.
MODEL_NAME = "SmolLM2-135M-Instruct"
# A server small enough for the 2-core CI machine: float32 on CPU, a KV pool of 512 MiB (8192 tokens of SmolLM2 fit).
KESTREL_ARGS = ["--dtype", "float32", "--kv-cache-memory", "512MiB"]


class RemoteOpenAIServer:
    def __init__(self, model: str | None, args: list[str], **_: object) -> None:
        self.server = Server(*([model] if model and model != MODEL_NAME else []), *KESTREL_ARGS, *args)
        self.show_hidden_metrics = False

    def __enter__(self) -> RemoteOpenAIServer:
        try:
            self.server.wait_ready()
        except BaseException:
            self.server.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    @property
    def url_root(self) -> str:
        return self.server.url

    def url_for(self, *parts: str) -> str:
        return "/".join([self.server.url, *parts])

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="unused", max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="unused", max_retries=0, **kwargs)


def get_tokenizer(tokenizer_name: str | None = None, **_: object):
    """vLLM's `get_tokenizer`: here the default model's tokenizer, whatever the name."""
    from kestrel.model.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model(None))

