from __future__ import annotations

import math
import random
import warnings
import zlib
from collections import Counter

import pytest
import torch

from common.engine.core.sampling_params import SamplingParams
from common.engine.core.sequence import Sequence
from common.engine.sampler import Sampler, _apply_penalties

# A handmade 6-token distribution; its logits are log-probabilities.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.07, 0.03]
LOGITS = [math.log(p) for p in PROBS]
DRAWS = 2000


def _seq(request_id: str = "r", prompt: list[int] | None = None, outputs: list[int] | None = None,
         eos: tuple[int, ...] = (), **params: object) -> Sequence:
    seq = Sequence(request_id, list(prompt or [0]), SamplingParams(**params), eos_token_ids=eos)
    for token in outputs or []:
        seq.append_token(token)
    return seq


def _frequencies(**params: object) -> dict[int, float]:
    torch.manual_seed(1234)
    logits = torch.tensor([LOGITS] * DRAWS)
    seqs = [_seq(f"r{i}", **params) for i in range(DRAWS)]
    counts = Counter(Sampler()(logits, seqs).token_ids)
    return {token: n / DRAWS for token, n in counts.items()}


def _renormalised(allowed: list[int], probs: list[float] = PROBS) -> dict[int, float]:
    total = sum(probs[t] for t in allowed)
    return {t: probs[t] / total for t in allowed}


def _assert_distribution(seen: dict[int, float], expected: dict[int, float]) -> None:
    assert set(seen) == set(expected)
    for token, p in expected.items():
        assert seen[token] == pytest.approx(p, abs=0.04), (token, seen, expected)


def test_greedy_is_argmax_and_consumes_no_randomness() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    seqs = [_seq(f"r{i}", temperature=0.0, seed=i if i % 2 else None) for i in range(8)]
    state = torch.get_rng_state()
    out = Sampler()(logits, seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(torch.get_rng_state(), state)


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    seqs = [_seq(f"r{i}", temperature=1.5, top_k=1, top_p=0.9) for i in range(6)]
    assert Sampler()(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = 100.0  # the sampled row is all but certain to pick 7
    seqs = [_seq("a", temperature=0.0), _seq("b"), _seq("c", temperature=0.0), _seq("d", top_k=1)]
    out = Sampler()(logits, seqs).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert out == [argmax[0], 7, argmax[2], argmax[3]]


@pytest.mark.parametrize(("params", "allowed"), [
    ({}, [0, 1, 2, 3, 4, 5]),
    ({"top_k": 3}, [0, 1, 2]),
    ({"top_p": 0.6}, [0, 1]),  # mass above token 2 is 0.65 >= 0.6
    ({"top_p": 0.7}, [0, 1, 2]),
    ({"min_p": 0.3}, [0, 1, 2]),  # floor 0.12
    # top-k first: [.4, .25, .15, .1] / .9 puts .722 above token 2, so top-p 0.7 drops it
    ({"top_k": 4, "top_p": 0.7}, [0, 1]),
    ({"min_p": 0.2, "top_k": 5}, [0, 1, 2, 3]),  # floor 0.08
])
def test_masks_keep_exactly_the_allowed_tokens(params: dict, allowed: list[int]) -> None:
    _assert_distribution(_frequencies(**params), _renormalised(allowed))


def test_temperature_sharpens() -> None:
    squared = [p * p for p in PROBS]
    expected = _renormalised(list(range(6)), squared)
    _assert_distribution(_frequencies(temperature=0.5), expected)


def test_temperature_applies_before_min_p() -> None:
    # At temperature 0.5 the probabilities are PROBS squared, renormalised, so min_p 0.35 keeps
    # squared probs >= 0.35 * 0.16 = 0.056: tokens 0 and 1 (before temperature it would keep 2).
    squared = [p * p for p in PROBS]
    _assert_distribution(_frequencies(temperature=0.5, min_p=0.35), _renormalised([0, 1], squared))


def test_penalties_exact() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    seq = _seq(prompt=[0, 1], outputs=[3, 3, 4], repetition_penalty=2.0, frequency_penalty=0.5,
               presence_penalty=0.25)
    _apply_penalties(logits, [seq], [1])
    # repetition over prompt + outputs {0, 1, 3, 4}: positive / 2, negative * 2; then token 3
    # (2 outputs) loses 2 * 0.5 + 0.25, token 4 (1 output) loses 0.5 + 0.25.
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                               [1.0, -2.0, 0.5, 0.25, -4.75, 0.0]]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5]] * 3)
    seqs = [_seq("a", temperature=0.0, outputs=[1], presence_penalty=1.0),
            _seq("b", temperature=0.0, prompt=[1], repetition_penalty=1.5),
            _seq("c", temperature=0.0, prompt=[1], outputs=[1])]
    assert Sampler()(logits, seqs).token_ids == [2, 2, 1]
    assert logits.tolist() == [[1.0, 3.0, 2.5]] * 3  # the caller's logits are not modified


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 4)
    seqs = [_seq("a", temperature=0.0, eos=(2,), min_tokens=2, outputs=[0]),
            _seq("b", temperature=0.0, eos=(2,), min_tokens=2, stop_token_ids=[3]),
            _seq("c", temperature=0.0, eos=(2,), min_tokens=2, outputs=[0, 0]),
            _seq("d", temperature=0.0, eos=(2,), stop_token_ids=[3])]
    assert Sampler()(logits, seqs).token_ids == [3, 4, 2, 2]


def test_logprobs_are_raw_log_softmax_top_n_sorted() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    seqs = [_seq("a", logprobs=5, temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 3]),
            _seq("b", logprobs=0, temperature=0.7, top_k=10),
            _seq("c"),
            _seq("d", logprobs=1, temperature=0.0)]
    out = Sampler()(logits, seqs)
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 1)]:
        entry = out.logprobs[i]
        assert entry is not None and entry.token_id == out.token_ids[i]
        assert entry.logprob == expected[i, entry.token_id].item()
        values, ids = expected[i].topk(n)
        assert entry.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)


SEEDED = {
    "s1": {"seed": 11, "temperature": 0.9},
    "s2": {"seed": 22, "top_p": 0.8, "frequency_penalty": 0.5},
    "s3": {"seed": 33, "top_k": 20, "min_p": 0.05, "logprobs": 2},
    "s4": {"seed": 11, "temperature": 1.3, "repetition_penalty": 1.2},  # same seed as s1
}
UNSEEDED = {"u1": {}, "u2": {"top_p": 0.9}, "u3": {"temperature": 0.0}, "u4": {"top_k": 5}}
VOCAB = 500
STEPS = 12


def _step_logits(request_id: str, step: int, device: str) -> torch.Tensor:
    # Flat-ish logits so sampling is genuinely random; a function of (request, step) only.
    g = torch.Generator().manual_seed(zlib.crc32(f"{request_id}/{step}".encode()))
    return (torch.randn(VOCAB, generator=g) * 0.5).to(device)


def _run(orders: list[list[str]], params: dict[str, dict], device: str) -> dict[str, list[int]]:
    """Sample one token per request per step; orders[step] is that step's batch, in order."""
    sampler = Sampler()
    seqs = {rid: _seq(rid, prompt=[1, 2, 3], **p) for rid, p in params.items()}
    for step, order in enumerate(orders):
        batch = [seqs[rid] for rid in order]
        logits = torch.stack([_step_logits(s.request_id, step, device) for s in batch])
        for seq, token in zip(batch, sampler(logits, batch).token_ids, strict=True):
            seq.append_token(token)
    return {rid: seq.output_token_ids for rid, seq in seqs.items()}


def _check_seeded_invariance(device: str) -> None:
    alone = {rid: _run([[rid]] * STEPS, {rid: SEEDED[rid]}, device)[rid] for rid in SEEDED}
    everyone = {**SEEDED, **UNSEEDED}
    in_batch = _run([list(everyone)] * STEPS, everyone, device)
    shuffled_orders = [random.Random(step).sample(list(everyone), len(everyone))
                       for step in range(STEPS)]
    shuffled = _run(shuffled_orders, everyone, device)
    for rid in SEEDED:
        assert in_batch[rid] == alone[rid], rid
        assert shuffled[rid] == alone[rid], rid
    assert alone["s1"] != alone["s4"]  # same seed, different settings: different tokens
    assert len(set(map(tuple, alone.values()))) == len(alone)


def test_seeded_rows_ignore_the_rest_of_the_batch() -> None:
    _check_seeded_invariance("cpu")


def test_seeded_stream_resumes_after_handoff_or_forget() -> None:
    full = _run([["s2"]] * STEPS, {"s2": SEEDED["s2"]}, "cpu")["s2"]
    # A second sampler (another service) receives the request with its first 5 tokens.
    seq = _seq("s2", prompt=[1, 2, 3], outputs=full[:5], **SEEDED["s2"])
    sampler = Sampler()
    for step in range(5, STEPS):
        seq.append_token(sampler(_step_logits("s2", step, "cpu")[None], [seq]).token_ids[0])
        if step == 8:
            sampler.forget("s2")
    assert seq.output_token_ids == full


def test_unseeded_rows_follow_the_global_rng() -> None:
    logits = torch.zeros(3, VOCAB)
    seqs = [_seq(f"u{i}") for i in range(3)]
    torch.manual_seed(5)
    first = Sampler()(logits, seqs).token_ids
    torch.manual_seed(5)
    assert Sampler()(logits, seqs).token_ids == first
    assert len(set(first)) == 3


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", ["greedy", "mixed"])
def test_bf16_logits_sample_as_their_float32_upcast(device: str, batch: str) -> None:
    """The CUDA decode graphs hand the sampler logits in the model's dtype: the same tokens
    and logprobs as their float32 upcast, for a plain greedy batch (argmax of the bf16 rows,
    ties included) and for one that samples, penalises, masks and asks for logprobs."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 300, generator=gen) * 4).to(torch.bfloat16)
    logits[2, 17] = logits[2, 230] = logits[2].max() + 1   # a tie: the lower index wins
    logits = logits.to(device)
    if batch == "greedy":
        rows = [dict(temperature=0.0) for _ in range(6)]
    else:
        rows = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3),
                dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.8, seed=1),
                dict(temperature=0.0, min_tokens=2), dict(temperature=0.7, top_k=20, seed=2)]

    def run(x: torch.Tensor):
        seqs = [_seq(f"r{i}", prompt=[17, 40], outputs=[5], eos=(230,), **p)
                for i, p in enumerate(rows)]
        return Sampler()(x, seqs)

    low, upcast = run(logits), run(logits.float())
    assert low.token_ids == upcast.token_ids
    assert low.logprobs == upcast.logprobs
    if batch == "greedy":
        assert low.token_ids == logits.float().argmax(dim=-1).tolist()
        assert low.token_ids[2] == 17


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 5), [_seq()])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_seeded_rows_ignore_the_rest_of_the_batch_cuda() -> None:
    _check_seeded_invariance("cuda")


@pytest.mark.gpu
@cuda
def test_sampling_launches_without_a_host_sync_cuda() -> None:
    """sample() queues everything (uploads from pinned memory, the copy of the tokens back) and
    never waits for the device; result() then waits on the one event of that copy."""
    params = [{**p} for p in (*SEEDED.values(), *UNSEEDED.values())]
    seqs = [_seq(f"r{i}", prompt=[1, 2], outputs=[3], eos=(4,), min_tokens=3, **p)
            for i, p in enumerate(params)]
    logits = torch.randn(len(seqs), VOCAB, device="cuda")
    sampler = Sampler()
    sampler(logits, seqs)  # the first call creates the seeded generators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = sampler.sample(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], [str(w.message) for w in syncs]
    assert len(pending.result().token_ids) == len(seqs)
