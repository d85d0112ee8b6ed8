"""`/tokenize`, `/detokenize` and `/tokenizer_info` (vLLM's extensions): the server's own tokenizer
and chat template."""

from __future__ import annotations

from typing import Any

from kestrel.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kestrel.entrypoints.openai.serving_engine import APIError, OpenAIServing, template_kwargs


class OpenAIServingTokenization(OpenAIServing):

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400, "prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await self.in_tokenizer_thread(self.chat_prompt_ids, req.messages, req.add_generation_prompt,
                                                 template_kwargs(req), tools=tools)
        else:
            ids = await self.in_tokenizer_thread(self.prompt_ids, req.prompt, req.add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.max_model_len,
                "token_strs": token_strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        return {"prompt": await self.in_tokenizer_thread(self.tokenizer.decode, req.tokens)}

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration, as vLLM's /tokenizer_info: its init arguments (special
        tokens, model_max_length, ...), the added tokens by id, the chat template and its class."""
        tok = self.tokenizer
        info: dict[str, Any] = {k: json_safe(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
                                if k not in ("tokenizer_object", "added_tokens_decoder", "name_or_path",
                                             "tokenizer_file", "vocab_file", "merges_file")}
        added = getattr(tok, "added_tokens_decoder", None) or {}
        info["added_tokens_decoder"] = {str(i): {"content": t.content, "special": bool(t.special),
                                                 "lstrip": bool(t.lstrip), "rstrip": bool(t.rstrip),
                                                 "normalized": bool(t.normalized),
                                                 "single_word": bool(t.single_word)}
                                        for i, t in added.items()}
        template = getattr(tok, "chat_template", None)
        if isinstance(template, str):
            info["chat_template"] = template
        info["tokenizer_class"] = type(tok).__name__
        return info


def json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    content = getattr(value, "content", None)  # an AddedToken
    return content if isinstance(content, str) else str(value)
