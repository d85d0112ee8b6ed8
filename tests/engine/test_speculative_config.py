"""Speculative decoding (issue 19): --speculative-config as vLLM takes it (kestrel/engine/arg_utils.py), and
a clear error for what it does not."""

from __future__ import annotations

import pytest

from kestrel.config import SpeculativeConfig
from kestrel.engine.arg_utils import speculative_config


def test_speculative_config_as_vllm_takes_it():
    c = speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 4, 2)
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (1, 1)
    assert SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3}).method == "draft_model"
    c = speculative_config({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/some/draft", 3)
    assert speculative_config(None) is None


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a \"model\""),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_speculative_config_is_a_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        speculative_config(bad)
