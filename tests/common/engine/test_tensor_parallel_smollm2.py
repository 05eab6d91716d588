"""SmolLM2-135M-Instruct (9 heads, 3 KV heads, one KV head a rank) at tensor parallel size 3 on
CPU ranks: the engine-equivalence prompts of test_engine.py give HF transformers' greedy tokens
(float32), and TP 1's, with chunked prefill, prefix-cache hits and preemption on the way."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from tests.common.engine.test_engine import build_prompts, hf_greedy_outputs

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)

pytestmark = pytest.mark.slow


def smollm2(model_cache_dir, tp: int, **kw) -> LLMEngine:
    cfg = dict(model="SmolLM2-135M-Instruct", model_cache_dir=str(model_cache_dir),
               tensor_parallel_size=tp, num_kv_blocks=1024, max_num_batched_tokens=2048)
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg))


@pytest.fixture(scope="module")
def tp1(model_cache_dir) -> LLMEngine:
    return smollm2(model_cache_dir, 1)


@pytest.fixture(scope="module")
def prompts(tp1) -> list[list[int]]:
    return build_prompts(tp1.tokenizer)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir, prompts) -> list[list[int]]:
    return hf_greedy_outputs(smollm2_dir, prompts, NEW_TOKENS)


def test_tp3_matches_tp1_and_hf(model_cache_dir, tp1, prompts, hf_greedy):
    """A 64-token step budget chunks every long prompt; 80 blocks of 16 cannot hold the 16
    prompts at once (preemption); prompt 10's first 48 tokens are asked twice (a cache hit)."""
    want = [o.output_token_ids for o in tp1.generate(prompts, GREEDY)]
    assert want == hf_greedy
    engine = smollm2(model_cache_dir, 3, num_kv_blocks=80, max_num_batched_tokens=64)
    try:
        got = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"prompt {i} ({len(prompts[i])} tokens) differs"
        assert engine.scheduler.num_preemptions > 0
        asked = prompts[10][:48] + [504, 1029]
        first, again = (engine.generate([asked], GREEDY)[0] for _ in range(2))
        assert again.num_cached_tokens == 48
        assert first.output_token_ids == again.output_token_ids == tp1.generate(
            [asked], GREEDY)[0].output_token_ids
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()
