"""`SamplingParams.prompt_logprobs` end to end, checked against transformers' log-softmax over the
whole prompt on a tiny random-weight Llama built here (float32): alone and batched, with chunked
prefill, with forced preemption (recompute must not send a prompt position twice), next to requests
that do not ask, with n > 1, and through the asynchronous front end's streams.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.scheduler import Scheduler
from tests.support.parity import save_tiny_llama

VOCAB = 49152  # the default model's tokenizer is reused, so the vocabulary matches it
ATOL = 1e-4
LENGTHS = [1, 2, 9, 17, 40, 77]
KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    return str(folder), save_tiny_llama(folder, vocab_size=VOCAB)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 log-softmax; row p predicts prompt token p + 1."""
    return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def assert_prompt_logprobs(ours, ref: torch.Tensor, prompt: list[int], num_top: int) -> None:
    assert ours is not None and len(ours) == len(prompt), (None if ours is None else len(ours), len(prompt))
    assert ours[0] is None
    if len(prompt) == 1:
        return
    # Whole-prompt tensor ops (many small ones are slow on a busy machine).
    rows = ref[:-1]
    actual_lp = rows.gather(1, torch.tensor(prompt[1:])[:, None])
    # The actual token's rank in the full distribution, up to float noise between near-tied tokens.
    rank_lo = ((rows > actual_lp + ATOL).sum(dim=-1) + 1).tolist()
    rank_hi = ((rows > actual_lp - ATOL).sum(dim=-1) + 1).tolist()
    top_values, top_ids = (t.tolist() for t in rows.topk(num_top + 1, dim=-1))
    for i in range(1, len(prompt)):
        entry, actual, values, ids = ours[i], prompt[i], top_values[i - 1], top_ids[i - 1]
        assert actual in entry, (i, entry)
        lp = entry[actual]
        assert abs(lp.logprob - actual_lp[i - 1, 0].item()) <= ATOL, (i, lp, actual_lp[i - 1, 0].item())
        assert rank_lo[i - 1] <= lp.rank <= rank_hi[i - 1], (i, lp.rank, rank_lo[i - 1], rank_hi[i - 1])
        assert lp.decoded_token is not None
        top = {t: v for t, v in entry.items() if v.rank <= num_top}
        assert len(entry) - len(top) <= 1  # at most the actual token on top of the top-N
        if num_top and values[num_top - 1] - values[num_top] > ATOL:  # no near-tie at the cut
            assert set(top) == set(ids[:num_top]), (i, sorted(top), ids[:num_top])
        for t, v in top.items():
            assert abs(v.logprob - ref[i - 1, t].item()) <= ATOL, (i, t, v)
            # A top-N entry's rank is its place in the top-N.
            assert ids[v.rank - 1] == t or abs(values[v.rank - 1] - v.logprob) <= ATOL


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_matches_transformers_alone_and_batched(tiny, engine_check):
    folder, model = tiny
    prompts = make_prompts(LENGTHS)
    refs = [reference(model, p) for p in prompts]
    llm = LLM(folder, enable_prefix_caching=True, **KW)
    for prompt, ref in zip(prompts, refs):
        out = generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))[0]
        assert_prompt_logprobs(out.prompt_logprobs, ref, prompt, 5)
        assert len(out.outputs[0].token_ids) == 2
    # Batched, with a different N per request (0: only the actual token). Prefix caching is on and
    # the same prompts ran above: a request that asks for prompt logprobs must still compute them.
    tops = [0, 1, 5, 20, 3, 2]
    outs = generate(llm, prompts, [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k) for k in tops])
    for out, prompt, ref, k in zip(outs, prompts, refs, tops):
        assert_prompt_logprobs(out.prompt_logprobs, ref, prompt, k)
        assert out.num_cached_tokens == 0
        if k == 0:
            assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    engine_check(llm)


def test_chunked_prefill(tiny, engine_check):
    folder, model = tiny
    prompts = make_prompts(LENGTHS, seed=1)
    llm = LLM(folder, max_num_batched_tokens=8, **KW)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4))
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs(out.prompt_logprobs, reference(model, prompt), prompt, 4)
    engine_check(llm)


def test_preemption_sends_each_position_once(tiny, engine_check, monkeypatch):
    folder, model = tiny
    prompts = make_prompts([150, 100, 77, 40], seed=2)
    resent = []  # rows the worker recomputed after a preemption (dropped by the scheduler)
    take = Scheduler._take_prompt_logprobs

    def spy(self, runner_output):
        for rid, (first, _) in runner_output.prompt_logprobs.items():
            request = self.requests.get(rid)
            if request is not None and first <= request.num_prompt_logprobs_sent:
                resent.append(rid)
        return take(self, runner_output)

    monkeypatch.setattr(Scheduler, "_take_prompt_logprobs", spy)
    # A 20-token budget splits every prompt; 17 blocks of 16 barely hold one 256-token sequence.
    llm = LLM(folder, dtype="float32", max_model_len=256, max_num_batched_tokens=20, num_kv_blocks=17,
              enable_prefix_caching=False)
    outs = generate(llm, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=3))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    assert resent, "no request was preempted while its prompt logprobs were under way"
    for out, prompt in zip(outs, prompts):
        assert_prompt_logprobs(out.prompt_logprobs, reference(model, prompt), prompt, 3)
        assert len(out.outputs[0].token_ids) == 40
    engine_check(llm)


def test_requests_that_do_not_ask_are_unchanged(tiny, engine_check):
    folder, model = tiny
    asks, plain = make_prompts([33, 21], seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    llm = LLM(folder, max_num_batched_tokens=16, **KW)
    alone = generate(llm, [plain], params)[0]
    both = generate(llm, [asks, plain], [params.clone(prompt_logprobs=2), params])
    assert_prompt_logprobs(both[0].prompt_logprobs, reference(model, asks), asks, 2)
    assert both[1].prompt_logprobs is None and alone.prompt_logprobs is None
    a, b = alone.outputs[0], both[1].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        assert all(abs(x[t].logprob - y[t].logprob) <= ATOL for t in x)
    engine_check(llm)


def test_n_samples_return_one_list(tiny, engine_check):
    folder, model = tiny
    prompt = make_prompts([25], seed=4)[0]
    llm = LLM(folder, max_num_batched_tokens=8, **KW)
    out = generate(llm, [prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=2))[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 4 for c in out.outputs)
    assert_prompt_logprobs(out.prompt_logprobs, reference(model, prompt), prompt, 2)
    engine_check(llm)


def test_validation():
    SamplingParams(prompt_logprobs=20).validate()
    SamplingParams(prompt_logprobs=0).validate()
    for bad in (21, -1):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()


@pytest.mark.slow
def test_async_stream_delivers_them_once_complete(tiny):
    from kestrel.engine.arg_utils import EngineArgs
    from kestrel.engine.async_llm import AsyncLLM
    folder, model = tiny
    prompt = make_prompts([45], seed=5)[0]
    ref = reference(model, prompt)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=folder, dtype="float32", max_model_len=256,
                                                  kv_cache_memory=16 << 20, max_num_batched_tokens=8))
    try:
        async def run(params, stream):
            return [out async for out in engine.generate({"prompt_token_ids": prompt}, params, stream=stream)]

        for n in (1, 2):
            params = SamplingParams(n=n, temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=3)
            streamed = asyncio.run(run(params, True))
            assert streamed[0].prompt_logprobs is not None
            assert all(o.prompt_logprobs is None for o in streamed[1:])
            assert_prompt_logprobs(streamed[0].prompt_logprobs, ref, prompt, 3)
            assert sum(len(c.token_ids) for o in streamed for c in o.outputs) == 5 * n
            final = asyncio.run(run(params, False))
            assert len(final) == 1
            assert_prompt_logprobs(final[0].prompt_logprobs, ref, prompt, 3)
    finally:
        engine.shutdown()
