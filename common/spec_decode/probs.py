"""The distribution the plain sampler draws a token from, as probabilities.

Sampler._sample (common/sampler.py) computes exactly this (temperature, then min-p, then top-k /
top-p, then softmax) before racing exponential noise: verification must judge drafts against
the same p. tests/common/spec_decode/test_rejection.py checks the two agree token for token.
"""

from __future__ import annotations

import torch

from common.sampler import _to_device, _top_k, _top_k_top_p
from common.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [n, vocab] float32 (after min_tokens masking and penalties); row i is sampled
    with params[i] (temperature > 0) -> [n, vocab] probabilities."""
    vocab = logits.shape[1]
    settings = _to_device(
        [[p.temperature, p.min_p, float(p.top_k if p.top_k > 0 else vocab), p.top_p]
         for p in params], torch.float32, logits.device)
    logits = logits / settings[:, 0:1]
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(dim=-1)
        floor = settings[:, 1:2] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    top_k = settings[:, 2:3].long()
    if any(p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, top_k, settings[:, 3:4])
    elif any(p.top_k > 0 for p in params):
        logits = _top_k(logits, top_k, max(min(p.top_k, vocab) for p in params))
    return logits.softmax(dim=-1)
