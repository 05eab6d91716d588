"""Verification: exact greedy cases, the coupled rule for deterministic drafts (seeded requests
reproduce plain sampling), and the distribution of emitted tokens for sampled drafts."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine.core.sampling_params import SamplingParams
from common.engine.core.sequence import Sequence
from common.engine.sampler import Sampler, processed_probs
from common.spec_decode.rejection import RejectionSampler
from tests.common.spec_decode.stats import fits

pytestmark = pytest.mark.usefixtures("one_thread")


def _seq(rid: str = "r", outputs: int = 0, eos: tuple[int, ...] = (), **params) -> Sequence:
    seq = Sequence(rid, [0, 1], SamplingParams(**params), eos_token_ids=eos)
    for _ in range(outputs):
        seq.append_token(1)
    return seq


def _one_hot_logits(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


SETTINGS = [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1),
            dict(temperature=1.3, top_k=20, top_p=0.9), dict(temperature=0.5, min_p=0.05, top_k=7)]


@pytest.mark.parametrize("settings", SETTINGS)
def test_processed_probs_is_what_the_sampler_draws_from(settings: dict) -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(1)) * 2
    seqs = [_seq(f"r{i}", seed=100 + i, **settings) for i in range(16)]
    tokens = Sampler()(logits, seqs).token_ids
    probs = processed_probs(logits, [s.params for s in seqs])
    for i in range(16):
        noise = torch.empty(100).exponential_(generator=torch.Generator().manual_seed(100 + i))
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        assert (probs[i] / noise).argmax().item() == tokens[i]


def test_greedy_accepts_the_matching_prefix_then_corrects() -> None:
    seqs = [_seq("a", temperature=0.0), _seq("b", temperature=0.0), _seq("c", top_k=1)]
    drafts = [[3, 5, 1], [4], [6, 6]]
    logits = _one_hot_logits([3, 5, 2, 7] + [4, 6] + [0, 6, 6])
    out = RejectionSampler(Sampler())(logits, seqs, drafts, [None, None, None])
    assert out.token_ids == [[3, 5, 2], [4, 6], [0]]
    assert out.num_accepted == [2, 1, 0]


def test_min_tokens_masks_stop_tokens_at_draft_positions() -> None:
    # Output counts at the three positions: 1, 2, 3; EOS (2) is allowed from the third on.
    seq = _seq(outputs=1, eos=(2,), temperature=0.0, min_tokens=3, stop_token_ids=[4])
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 8.0, 7.0, 0.0, 0.0]] * 3)
    out = RejectionSampler(Sampler())(logits, [seq], [[5, 5]], [None])
    assert out.token_ids == [[5, 5, 2]]


def _position_logits(step: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


def test_deterministic_drafts_reproduce_seeded_plain_sampling() -> None:
    params = dict(seed=7, temperature=0.9, top_k=30)
    plain = _seq("p", **params)
    sampler = Sampler()
    for step in range(12):
        plain.append_token(sampler(_position_logits(step)[None], [plain]).token_ids[0])
    want = plain.output_token_ids
    # The same request, speculating: drafts right, then wrong, then right again.
    spec = _seq("s", **params)
    verifier = RejectionSampler(Sampler())
    for drafts in ([want[0], want[1], 0], [want[3], want[4], want[5]], [want[7]], [want[9], 1]):
        n = spec.num_output_tokens
        drafts = [t for t in drafts if t is not None]
        logits = torch.stack([_position_logits(n + j) for j in range(len(drafts) + 1)])
        out = verifier(logits, [spec], [drafts], [None])
        for t in out.token_ids[0]:
            spec.append_token(t)
    assert spec.output_token_ids == want[:spec.num_output_tokens]
    assert spec.num_output_tokens == 3 + 4 + 2 + 2
    # The generator was rewound to one row per emitted token: plain sampling continues in step.
    for step in range(spec.num_output_tokens, 12):
        spec.append_token(verifier.sampler(_position_logits(step)[None], [spec]).token_ids[0])
    assert spec.output_token_ids == want


P = [[0.35, 0.25, 0.2, 0.1, 0.06, 0.04], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3],
     [0.3, 0.1, 0.3, 0.1, 0.1, 0.1]]
Q = [[0.02, 0.03, 0.05, 0.1, 0.3, 0.5], [0.5, 0.3, 0.1, 0.05, 0.03, 0.02]]
N = 20000


def _speculate(params: dict, sampled_drafts: bool, seed: int = 0
               ) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """N sequences with two drafts each against target logits log P at every position. Sampled
    drafts come from Q (far from P) and are verified with Q; deterministic ones (q one-hot) are
    drawn from P[:2] so that enough of them reach the third position."""
    torch.manual_seed(seed)
    dist = torch.tensor(Q if sampled_drafts else P[:2])
    drafts = torch.stack([torch.multinomial(dist[j], N, replacement=True) for j in range(2)],
                         dim=1).tolist()
    logits = torch.tensor(P).log().repeat(N, 1)
    seqs = [_seq(f"r{i}", **params) for i in range(N)]
    probs = [dist if sampled_drafts else None] * N
    out = RejectionSampler(Sampler())(logits, seqs, drafts, probs)
    return out.token_ids, out.num_accepted, drafts


def _expected(j: int, **params) -> dict[int, float]:
    p = processed_probs(torch.tensor(P[j]).log()[None], [SamplingParams(**params)])[0]
    return {t: v for t, v in enumerate(p.tolist())}


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.6, top_k=4)])
@pytest.mark.parametrize("sampled_drafts", [True, False])
def test_emitted_tokens_follow_the_target_distribution(params: dict,
                                                       sampled_drafts: bool) -> None:
    tokens, accepted, drafts = _speculate(params, sampled_drafts)
    for j in range(3):  # position j is reached when the j drafts before it were accepted
        emitted = [t[j] for t in tokens if len(t) > j]
        assert len(emitted) > 300
        assert fits(emitted, _expected(j, **params)), j
    assert sum(a > 0 for a in accepted) < 0.5 * N  # the drafts disagree often
    if sampled_drafts:  # and accepting them blindly would be caught
        assert not fits([d[0] for d in drafts], _expected(0, **params))


def test_sampled_drafts_accept_with_probability_min_one_p_over_q() -> None:
    _, accepted, _ = _speculate({}, sampled_drafts=True)
    rate = sum(a > 0 for a in accepted) / N
    expected = sum(min(p, q) for p, q in zip(P[0], Q[0], strict=True))
    assert rate == pytest.approx(expected, abs=4 * math.sqrt(expected / N))


def test_seeded_sampled_drafts_are_deterministic() -> None:
    runs = []
    for _ in range(2):
        seqs = [_seq(f"r{i}", seed=i) for i in range(64)]
        drafts = [[i % 6, (i // 6) % 6] for i in range(64)]
        logits = torch.tensor(P).log().repeat(64, 1)
        out = RejectionSampler(Sampler())(logits, seqs, drafts, [torch.tensor(Q)] * 64)
        runs.append(out.token_ids)
    assert runs[0] == runs[1]
