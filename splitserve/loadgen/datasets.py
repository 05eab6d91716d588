"""Benchmark workloads as token ids and output lengths, synthesised locally from a seed.

Prompts are random token ids from [FIRST_ID, vocab_size) (clear of the special tokens at the
bottom of the vocabularies used here); outputs have a fixed length (requests ignore EOS).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_ID = 100

# ShareGPT (the conversations vLLM benchmarks with) averages ~161 prompt and ~338 output tokens
# per request, with long right tails; lognormal lengths with these means and spreads imitate it.
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT = 161, 338
SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT = 1.0, 0.8


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def _around(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_lengths(n: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int) -> list[BenchRequest]:
    """Lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, _around(rng, input_len, range_ratio), vocab_size),
                         _around(rng, output_len, range_ratio)) for _ in range(n)]


def shared_prefix(n: int, shared_len: int, new_len: int, output_len: int, vocab_size: int,
                  seed: int) -> list[BenchRequest]:
    """One system prompt of shared_len tokens, then new_len tokens of each request's own."""
    rng = random.Random(seed)
    system = _ids(rng, shared_len, vocab_size)
    return [BenchRequest(system + _ids(rng, new_len, vocab_size), output_len)
            for _ in range(n)]


def sharegpt_like(n: int, mean_input: int, mean_output: int, max_input: int, max_output: int,
                  vocab_size: int, seed: int) -> list[BenchRequest]:
    """Lognormal prompt and output lengths with the given means, clipped to [4, max]."""
    rng = random.Random(seed)

    def length(mean: int, sigma: float, cap: int) -> int:
        mu = math.log(mean) - sigma * sigma / 2  # so that the mean is `mean`
        return min(cap, max(4, round(rng.lognormvariate(mu, sigma))))

    out = []
    for _ in range(n):
        p = length(mean_input, SHAREGPT_SIGMA_INPUT, max_input)
        o = length(mean_output, SHAREGPT_SIGMA_OUTPUT, max_output)
        out.append(BenchRequest(_ids(rng, p, vocab_size), o))
    return out
