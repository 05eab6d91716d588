"""n > 1 and prompt_logprobs on CUDA (skipped without it): the CUDA-graph runner with overlap
scheduling, where a choice forks while step N + 1 is in flight and placeholders stand for tokens
still on the device. Choices equal one-choice requests of their seeds, the pool is full after,
and prompt logprobs (whose steps leave the graphs) equal the CPU engine's on the same weights."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "dummy:tiny-llama"  # 512-token vocabulary
PROMPT = [random.Random(3).randrange(512) for _ in range(45)]  # 2 full blocks of 16 and 13


def engine(device: str, **kw) -> LLMEngine:
    cfg = dict(model=MODEL, device=device, dtype="float32", max_num_seqs=16,
               max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=256, block_size=16)
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg))


def run(e: LLMEngine, rid: str, params: SamplingParams) -> dict[int, list[int]]:
    e.add_request(rid, PROMPT, params)
    tokens: dict[int, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def cuda_engine() -> LLMEngine:
    e = engine("cuda")
    assert e.overlap  # on by default on CUDA
    yield e
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    e.block_manager.check_invariants()


def test_choices_under_overlap_scheduling(cuda_engine: LLMEngine):
    greedy = run(cuda_engine, "g", SamplingParams(max_tokens=20, temperature=0.0, n=4,
                                                  ignore_eos=True))
    alone = run(cuda_engine, "g1", SamplingParams(max_tokens=20, temperature=0.0,
                                                  ignore_eos=True))
    assert [greedy[i] for i in range(4)] == [alone[0]] * 4
    sampled = dict(max_tokens=20, temperature=1.0, top_k=50, ignore_eos=True)
    got = run(cuda_engine, "s", SamplingParams(seed=10, n=3, **sampled))
    for i in range(3):
        assert got[i] == run(cuda_engine, f"s{i}", SamplingParams(seed=10 + i, **sampled))[0]
    assert cuda_engine.runner.steps["graph"] > 0  # the decodes replayed graphs


def test_abort_mid_stream_frees_every_choice(cuda_engine: LLMEngine):
    cuda_engine.add_request("a", PROMPT, SamplingParams(max_tokens=100, n=3, ignore_eos=True))
    for _ in range(6):
        cuda_engine.step()
    assert cuda_engine.abort("a")
    while cuda_engine.has_unfinished():  # the step in flight
        cuda_engine.step()
    assert cuda_engine.block_manager.num_free_blocks == cuda_engine.block_manager.num_blocks


@pytest.mark.parametrize("length", [45, 150], ids=["one-chunk", "three-chunks"])
def test_prompt_logprobs_equal_the_first_token_logprobs(length: int):
    """Prompt position p's entry against the sampler's logprobs of a request whose prompt ends
    at p - 1 (its first token's distribution is the one at p - 1), on the same GPU and weights."""
    prompt = [random.Random(length).randrange(512) for _ in range(length)]
    e = engine("cuda")  # chunks of 64 tokens
    e.add_request("p", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4))
    got = None
    while e.has_unfinished():
        for out in e.step():
            if out.prompt_logprobs is not None:
                got = out.prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)
    firsts = e.generate([prompt[:p] for p in range(1, len(prompt))],
                        SamplingParams(max_tokens=1, temperature=0.0, logprobs=4))
    diff = 0.0
    for p, first in enumerate(firsts, start=1):
        want, lp = first.logprobs[0], got[p]
        assert lp.token_id == prompt[p]
        values = [v for _, v in want.top]
        assert [v for _, v in lp.top] == pytest.approx(values, abs=1e-4), f"position {p}"
        for i, (t, _) in enumerate(lp.top):  # the same tokens, where no near-tie can swap them
            gaps = [abs(values[i] - values[j]) for j in (i - 1, i + 1) if 0 <= j < len(values)]
            if min(gaps) > 1e-3:
                assert t == want.top[i][0], f"position {p}, top {i}"
        if lp.rank <= len(lp.top):
            assert lp.top[lp.rank - 1] == (lp.token_id, pytest.approx(lp.logprob))
        else:
            assert lp.logprob <= lp.top[-1][1]
        diff = max(diff, max(abs(a - b) for (_, a), (_, b) in zip(lp.top, want.top, strict=True)))
    print(f"{length} tokens: largest |prompt - sampler| top-4 logprob {diff:.2e}")
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
