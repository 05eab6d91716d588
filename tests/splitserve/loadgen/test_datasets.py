"""Workloads: seeded, in range, and shaped like the datasets they imitate."""

from __future__ import annotations

import statistics

from splitserve.loadgen import datasets


def test_random_lengths_are_seeded_and_in_range():
    a = datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a == datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=3)
    assert a != datasets.random_lengths(50, 100, 20, 0.5, vocab_size=1000, seed=4)
    assert all(50 <= len(r.prompt_token_ids) <= 150 and 10 <= r.max_tokens <= 30 for r in a)
    assert all(datasets.FIRST_ID <= t < 1000 for r in a for t in r.prompt_token_ids)
    fixed = datasets.random_lengths(5, 64, 8, 0.0, vocab_size=1000, seed=0)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in fixed] == [(64, 8)] * 5


def test_shared_prefix_shares_exactly_the_system_prompt():
    reqs = datasets.shared_prefix(4, shared_len=500, new_len=100, output_len=7,
                                  vocab_size=49152, seed=0)
    system = reqs[0].prompt_token_ids[:500]
    assert all(len(r.prompt_token_ids) == 600 and r.max_tokens == 7 for r in reqs)
    assert all(r.prompt_token_ids[:500] == system for r in reqs)
    assert len({tuple(r.prompt_token_ids[500:]) for r in reqs}) == 4


def test_sharegpt_like_lengths():
    reqs = datasets.sharegpt_like(4000, 161, 338, max_input=1024, max_output=1024,
                                  vocab_size=49152, seed=0)
    inputs = [len(r.prompt_token_ids) for r in reqs]
    outputs = [r.max_tokens for r in reqs]
    assert min(inputs) >= 4 and max(inputs) <= 1024 and max(outputs) <= 1024
    # Lognormal means of 161 and 338, a little lower after clipping the tails at 1024.
    assert 140 < statistics.mean(inputs) < 165 and 310 < statistics.mean(outputs) < 340
    assert statistics.median(inputs) < statistics.mean(inputs)  # a long right tail
