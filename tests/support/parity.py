"""Greedy parity with Hugging Face transformers (DESIGN.md, "Correctness reference")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel import LLM, SamplingParams

TOP = 5


@dataclass
class Greedy:
    token_ids: list[int]
    top: list[dict[int, float]]   # per step: the top-5 token ids → logprob


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[Greedy]:
    """Greedy generation with transformers, one prompt at a time (no padding), with top-5 logprobs."""
    results = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        tokens = out.sequences[0, len(ids):].tolist()
        top = []
        for logits in out.logits:
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            values, idx = lp.topk(TOP)
            top.append(dict(zip(idx.tolist(), values.tolist())))
        results.append(Greedy(tokens, top))
    return results


def kestrel_greedy(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[Greedy]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == max_new_tokens, c
        results.append(Greedy(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]))
    return results


def assert_greedy_close(ref: list[Greedy], ours: list[Greedy], *, exact: bool,
                        logprob_atol: float = 2e-3) -> int:
    """Compare greedy runs token by token. Before any divergence, the chosen token's logprob must
    agree within `logprob_atol` (this catches a wrong model even when tokens happen to agree).
    `exact`: every token must match. Otherwise vLLM's rule: at the first differing token, each
    side's token must be in the other's top-5, and comparison stops there. Returns how many
    sequences matched exactly."""
    num_exact = 0
    for i, (r, o) in enumerate(zip(ref, ours, strict=True)):
        for step, (a, b) in enumerate(zip(r.token_ids, o.token_ids, strict=True)):
            if a != b:
                assert not exact, f"prompt {i}: token {step} differs: transformers {a}, kestrel {b}"
                assert a in o.top[step] and b in r.top[step], (
                    f"prompt {i}: token {step} differs (transformers {a}, kestrel {b}) and is not in the "
                    f"other's top-{TOP}: {r.top[step]} / {o.top[step]}")
                break
            assert abs(r.top[step][a] - o.top[step][a]) <= logprob_atol, (
                f"prompt {i}, token {step}: logprob {o.top[step][a]} vs transformers {r.top[step][a]}")
        else:
            num_exact += 1
    return num_exact


def save_tiny_llama(folder, *, hidden_size: int = 64, intermediate_size: int = 128, vocab_size: int = 49152):
    """A 2-layer random-weight Llama (weights N(0, 0.08), seed 0) saved to `folder` with the default
    model's tokenizer, so the vocabulary matches it; returns the float32 transformers model."""
    from transformers import LlamaConfig
    return save_tiny_model(folder, LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))


def save_tiny_model(folder, config):
    """A random-weight model of `config` (matrices N(0, 0.08), seed 0) saved to `folder` with the
    default model's tokenizer; returns the float32 transformers model."""
    from transformers import AutoModelForCausalLM

    from kestrel.model.loader import load_tokenizer, resolve_model
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return model


def worker_of(llm):
    """The worker behind an in-process `LLM` (its model and model runner)."""
    return llm.llm_engine.engine_core.executor.driver_worker
