"""prompt_logprobs on SmolLM2-135M (CPU, float32) against HF transformers' float32 log_softmax of
the same prompt: every position's log-probability, rank and top-k, whether the prompt runs in one
chunk or several, at tensor-parallel size 1 or 3, and though its prefix is cached (such a request
computes every position)."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.errors import InvalidRequestError
from common.flags import build

TOP = 3


@pytest.fixture(scope="module")
def prompt(smollm2_dir) -> list[int]:
    from common.text.tokenizer import Tokenizer
    return Tokenizer.from_dir(smollm2_dir).encode(
        "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is "
        "Madrid, and the capital of Portugal is Lisbon.")


@pytest.fixture(scope="module")
def hf_logprobs(smollm2_dir, prompt) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is HF's log_softmax at position p (predicting p + 1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def prompt_logprobs(engine: LLMEngine, prompt: list[int], k: int) -> list:
    engine.add_request(f"p{id(prompt)}-{k}", prompt,
                       SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                got.append(out.prompt_logprobs)
    assert len(got) == 1  # sent once, with the first output
    return got[0]


@pytest.mark.parametrize(("batched_tokens", "tp"), [(2048, 1), (8, 1), (8, 3)],
                         ids=["one-chunk", "chunks-of-8", "chunks-of-8-tp3"])
def test_prompt_logprobs_match_hf(model_cache_dir, prompt, hf_logprobs, batched_tokens, tp):
    """At TP 3 every rank computes its vocabulary slice of the same prompt rows' logits, in
    rank 0's order (common/engine/parallel.py), one chunk per step."""
    engine = LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct", device="cpu",
                             model_cache_dir=str(model_cache_dir), num_kv_blocks=64,
                             block_size=16, cpu_threads=2, max_num_batched_tokens=batched_tokens,
                             tensor_parallel_size=tp))
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        got = prompt_logprobs(engine, prompt, TOP)
        assert len(got) == len(prompt) and got[0] is None
        for p in range(1, len(prompt)):
            lp, want = got[p], hf_logprobs[p - 1]
            assert lp.token_id == prompt[p]
            assert lp.logprob == pytest.approx(want[prompt[p]].item(), abs=1e-4)
            assert lp.rank == int((want > want[prompt[p]]).sum()) + 1
            top_v, top_i = want.topk(TOP)
            assert [t for t, _ in lp.top] == top_i.tolist(), f"position {p}"
            assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    assert [lp.top for lp in prompt_logprobs(engine, prompt, 0)[1:]] == [()] * (len(prompt) - 1)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_prompt_logprobs_out_of_range():
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
