"""The engine against HF transformers on SmolLM2-135M-Instruct (float32, CPU, greedy)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.errors import InvalidRequestError
from common.flags import build

NEW_TOKENS = 64
HF_BATCH = 4
TOPICS = [
    "the history of the printing press", "how a refrigerator works", "the rules of chess",
    "why the sky is blue", "a recipe for bread", "the life cycle of a star",
    "how to write a good unit test", "the causes of the French revolution",
]
FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the annual "
          "budget, and a small robot learns to paint landscapes in the evening light. ")


def build_prompts(tokenizer) -> list[list[int]]:
    """16 prompts of 10 to ~600 tokens, half chat-templated, half raw text."""
    rng = random.Random(7)
    prompts = []
    lengths = [10, 24, 40, 64, 90, 130, 170, 220, 260, 300, 350, 400, 450, 500, 560, 600]
    for i, target in enumerate(lengths):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Explain {topic}. "
        while len(tokenizer.encode(text)) < target - 12:
            text += FILLER[: rng.randint(40, len(FILLER))]
        if i % 2:
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True)
            ids = tokenizer.encode(chat, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        prompts.append(ids[:target] if i % 2 == 0 else ids)
    return prompts


@pytest.fixture(scope="module")
def engine_factory(model_cache_dir):
    engines = []

    def make(**kw) -> LLMEngine:
        cfg = dict(model="SmolLM2-135M-Instruct", model_cache_dir=str(model_cache_dir),
                   num_kv_blocks=1024, max_num_batched_tokens=2048)
        cfg.update(kw)
        engine = LLMEngine(build(EngineConfig, **cfg))
        engines.append(engine)
        return engine

    yield make
    for e in engines:  # after every test: zero blocks referenced
        assert e.block_manager.num_used_blocks == 0
        e.block_manager.check_invariants()


@pytest.fixture(scope="module")
def prompts(engine_factory):
    return build_prompts(engine_factory().tokenizer)


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir, prompts):
    return hf_greedy_outputs(smollm2_dir, prompts, NEW_TOKENS)


def hf_greedy_outputs(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF's greedy outputs, generated in batches of prompts of similar length (left-padded,
    masked): a fourth of the time of one prompt at a time, the same float32 model."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: dict[int, list[int]] = {}
    with torch.inference_mode():
        for group in (order[i:i + HF_BATCH] for i in range(0, len(order), HF_BATCH)):
            width = max(len(prompts[i]) for i in group)
            x = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(x)
            for row, i in enumerate(group):
                x[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            y = model.generate(x, attention_mask=mask, max_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0)
            for row, i in enumerate(group):   # a row that ended early is padded after its EOS
                out = y[row, width:].tolist()
                end = next((j + 1 for j, t in enumerate(out) if t in eos), len(out))
                outs[i] = out[:end]
    return [outs[i] for i in range(len(prompts))]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=32),
    dict(num_kv_blocks=48),
])
def test_greedy_matches_hf(engine_factory, prompts, hf_greedy, variant):
    engine = engine_factory(**variant)
    outs = engine.generate(prompts, GREEDY)
    got = [o.output_token_ids for o in outs]
    for i, (g, want) in enumerate(zip(got, hf_greedy, strict=True)):
        assert g == want, f"prompt {i} ({len(prompts[i])} tokens) differs"
    if variant.get("num_kv_blocks") == 48:
        assert engine.scheduler.num_preemptions > 0


def test_prefix_hit_computes_only_new_tokens(engine_factory, prompts):
    engine = engine_factory()
    base = prompts[10][:48]  # three full blocks
    first = engine.generate([base + [504, 1029, 3444]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    computed_before = engine.block_manager.prefix_hits
    second = engine.generate([base + [504, 1029, 3444]], GREEDY)[0]
    assert second.num_cached_tokens == 48
    assert engine.block_manager.prefix_hits - computed_before == 48
    uncached = engine_factory(enable_prefix_caching=False).generate(
        [base + [504, 1029, 3444]], GREEDY)[0]
    assert second.output_token_ids == first.output_token_ids == uncached.output_token_ids


def test_seeded_sampling_is_batch_independent(engine_factory, prompts):
    engine = engine_factory()
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate([prompts[3]], seeded)[0].output_token_ids
    others = [SamplingParams(max_tokens=30, temperature=1.0) for _ in range(5)]
    mixed = engine.generate([prompts[0], prompts[3], prompts[5], prompts[1], prompts[7],
                             prompts[2]], [others[0], seeded, *others[1:]])
    assert mixed[1].output_token_ids == alone


def test_stop_conditions(engine_factory, prompts):
    engine = engine_factory()
    free = engine.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0.0))[0]
    stop_id = free.output_token_ids[5]
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0.0,
                                                       stop_token_ids=[stop_id]))[0]
    assert out.output_token_ids == free.output_token_ids[:free.output_token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop"
    word = free.text.split()[2]
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=20, temperature=0.0,
                                                       stop=[word]))[0]
    assert out.finish_reason == "stop" and word not in out.text
    assert free.text.startswith(out.text)


def test_invalid_requests_are_refused(engine_factory):
    engine = engine_factory()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        engine.add_request("b", [1] * 8190, GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("c", [10**9], GREEDY)
    engine.add_request("d", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("d", [1, 2, 3], GREEDY)
    assert engine.abort("d")
    assert not engine.has_unfinished()
