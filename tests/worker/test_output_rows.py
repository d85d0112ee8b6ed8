"""Steps with prompt chunks compute their last layer past attention only for the rows that sample
(llama.cpp's unused-output skip): the model's forward given `output_rows` returns those rows' hidden
states, equal to the same rows of the whole forward, and the runner asks for them only where nothing
else reads the other rows."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.worker.model_runner import BatchInputs
from tests.support.parity import save_tiny_llama, worker_of

PROMPTS = [{"prompt_token_ids": [100 + (5 * i + 7 * j) % 4000 for j in range(n)]}
           for i, n in enumerate([150, 3, 70, 9, 33])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-rows")
    save_tiny_llama(folder, hidden_size=256, intermediate_size=512)
    return str(folder)


def _watch_forward(llm: LLM) -> list[tuple[int, int | None]]:
    """Checks each forward that asks for some rows against the whole forward on the same inputs; returns
    (tokens, rows asked for or None) per forward."""
    runner = worker_of(llm).runner
    model, forward = runner.model, runner.model.forward
    seen: list[tuple[int, int | None]] = []

    def checked(ids, positions, kv_caches, meta, intermediate=None, output_rows=None):
        hidden = forward(ids, positions, kv_caches, meta, intermediate, output_rows)
        seen.append((ids.shape[0], None if output_rows is None else output_rows.numel()))
        if output_rows is not None:
            assert hidden.shape == (output_rows.numel(), model.cfg.hidden_size)
            # The whole forward rewrites the same K/V to the same slots: running it second is harmless.
            whole = forward(ids, positions, kv_caches, meta, intermediate)
            # Rows of a product may round apart with the row count (torch's GEMM blocks by it).
            torch.testing.assert_close(hidden, whole.index_select(0, output_rows), rtol=2e-2, atol=2e-2)
        return hidden

    model.forward = checked
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prompt_chunks_compute_only_the_sampling_rows_and_give_the_same_tokens(tiny, dtype, engine_check,
                                                                               monkeypatch):
    """Chunked prefill (a 64-token budget): chunks that finish no prompt ask for no rows, chunks that
    finish one ask for its last token and the batch's decodes; the tokens and logprobs are those of a
    run that computes every row."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(model=tiny, dtype=dtype, max_model_len=512, kv_cache_memory=16 << 20, max_num_batched_tokens=64,
              enforce_eager=True)
    seen = _watch_forward(llm)
    pruned = llm.generate(PROMPTS, params, use_tqdm=False)
    engine_check(llm)
    asked = [rows for _, rows in seen if rows is not None]
    assert 0 in asked                                   # the first chunk of the 150-token prompt
    assert any(rows >= 2 for rows in asked)            # a finished prompt beside decodes
    assert all(rows < tokens for tokens, rows in seen if rows is not None)
    # The same run with every row computed (the runner's hidden_rows off).
    monkeypatch.setattr(BatchInputs, "hidden_rows", property(lambda batch: None))
    assert llm.llm_engine.engine_core.reset_prefix_cache()
    whole = llm.generate(PROMPTS, params, use_tqdm=False)
    engine_check(llm)
    for a, b in zip(pruned, whole):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for token in la:
                assert la[token].logprob == pytest.approx(lb[token].logprob, abs=2e-2)


def test_prompt_logprobs_keep_every_row(tiny):
    """A request scoring its prompt reads every row's hidden state: its steps compute them all."""
    llm = LLM(model=tiny, dtype="float32", max_model_len=512, kv_cache_memory=16 << 20, enforce_eager=True)
    seen = _watch_forward(llm)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1),
                       use_tqdm=False)
    assert all(rows is None for _, rows in seen)
    assert len(out[0].prompt_logprobs) == 150
