"""The offline Python API, shaped like vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kestrel.engine.arg_utils import EngineArgs
from kestrel.engine.llm_engine import LLMEngine
from kestrel.engine.processor import PromptType
from kestrel.outputs import RequestOutput
from kestrel.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        kwargs.setdefault("disable_log_stats", True)  # as vLLM's LLM: offline runs log no periodic stats
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`. Bad input
        raises ValueError before any prompt is queued."""
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Sequence):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        request_ids = [str(next(self._counter)) for _ in prompts]
        for p, sp in zip(prompts, params):  # validate everything before queueing anything
            self.llm_engine.processor.process("validate", p, sp)
        for rid, p, sp in zip(request_ids, prompts, params):
            self.llm_engine.add_request(rid, p, sp)
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt,
                                                                 **(chat_template_kwargs or {}))}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True,
                            **kwargs: Any) -> list[int]:
        tokenizer = self.get_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True, return_dict=False, **kwargs)
        return list(ids)

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one or one per prompt")
        return params

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(request_ids):
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                        total_out = sum(len(c.token_ids) for o in finished.values() for c in o.outputs)
                        bar.set_postfix_str(f"{total_out / max(bar.format_dict['elapsed'], 1e-9):.1f} out tok/s")
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
