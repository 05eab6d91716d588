"""Prompt lookup: exact proposals, and the incremental index equals a scan from scratch."""

import random

from common.engine.core.sampling_params import SamplingParams
from common.engine.core.sequence import Sequence
from common.spec_decode.ngram import NgramIndex, NgramProposer


def scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: longest suffix n-gram first, latest earlier occurrence."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert index.lookup(tokens, 4) == [8, 5, 1, 2]  # "1 2 3" last ended at 7
    tokens += [7]  # no earlier "2 3 7", "3 7" or "7"
    assert index.lookup(tokens, 4) == []
    tokens += [9]  # "9" seen at 3 (n = 1)
    assert index.lookup(tokens, 2) == [1, 2]


def test_min_n_and_continuation_into_the_tail():
    assert NgramIndex(2, 3).lookup([4, 5, 6, 5], 3) == []  # only a 1-gram matches
    assert NgramIndex(1, 3).lookup([4, 5, 6, 5], 3) == [6, 5]
    # The continuation may run into the suffix itself (a repeating pattern).
    assert NgramIndex(2, 2).lookup([7, 7, 7, 7], 5) == [7]


def test_incremental_index_matches_a_full_scan():
    rng = random.Random(0)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
        index = NgramIndex(min_n, max_n)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        for _ in range(40):
            k = rng.randrange(1, 6)
            assert index.lookup(tokens, k) == scan(tokens, k, min_n, max_n), (trial, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_proposer_keeps_one_index_per_request():
    proposer = NgramProposer(1, 2)
    a = Sequence("a", [1, 2, 3, 1, 2], SamplingParams())
    b = Sequence("b", [5, 6, 5], SamplingParams())
    drafts = proposer.propose([a, b], [2, 3])
    assert [d.token_ids for d in drafts] == [[3, 1], [6, 5]]
    assert all(d.probs is None for d in drafts)
    a.append_token(3)
    assert proposer.propose([a], [3])[0].token_ids == [1, 2, 3]
    proposer.forget("a")
    assert set(proposer.indexes) == {"b"}
