"""Speculative decoding (issue 19): the n-gram proposer (kestrel/worker/spec_decode.py), without a model."""

from __future__ import annotations

from kestrel.config import SpeculativeConfig
from kestrel.worker.spec_decode import NgramProposer


def ngram(k: int = 3, max_n: int = 3, min_n: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=max_n, prompt_lookup_min=min_n))


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # "1 2 3" occurred at 0 (then 9 9 1) and at 5 (then 7 8 5): the latest wins.
    assert ngram(k=3).propose(tokens) == [7, 8, 5]
    assert ngram(k=1).propose(tokens) == [7]


def test_ngram_prefers_the_longest_match_and_stops_at_min():
    # The last 2-gram "4 5" occurs at 0 (then 6); the last 1-gram "5" occurs later, at 4 (then 8).
    tokens = [4, 5, 6, 0, 5, 8, 4, 5]
    assert ngram(k=1, max_n=2, min_n=1).propose(tokens) == [6]
    assert ngram(k=1, max_n=1, min_n=1).propose(tokens) == [8]
    assert ngram(k=1, max_n=3, min_n=3).propose(tokens) == []   # "6 4 5"... no 3-gram recurs


def test_ngram_drafts_are_cut_at_the_end_of_the_context():
    assert ngram(k=4, max_n=2, min_n=2).propose([1, 2, 1, 2]) == [1, 2]
    assert ngram().propose([5]) == []
    assert ngram().propose([]) == []
