"""`/tokenize` and `/detokenize` (vLLM's extensions): the server's own tokenizer and chat template."""

from __future__ import annotations

from typing import Any

from kestrel.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kestrel.entrypoints.openai.serving_engine import APIError, OpenAIServing


class OpenAIServingTokenization(OpenAIServing):

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400, "prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await self.in_tokenizer_thread(self.chat_prompt_ids, req.messages, req.add_generation_prompt,
                                                 tools=tools)
        else:
            ids = await self.in_tokenizer_thread(self.prompt_ids, req.prompt, req.add_special_tokens)
        return {"tokens": list(ids), "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        return {"prompt": await self.in_tokenizer_thread(self.tokenizer.decode, req.tokens)}
