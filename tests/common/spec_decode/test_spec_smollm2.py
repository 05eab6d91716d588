"""Speculative decoding on the real model (SmolLM2-135M-Instruct, CPU, greedy): outputs identical
to plain decoding for 16 input-grounded prompts with n-gram and with a draft model, the n-gram
drafts are accepted, the prefix cache holds exactly plain decoding's blocks, and a draft equal
to the target is always accepted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, RequestOutput
from common.flags import build

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 32
WORDS = ["apples", "rivers", "copper", "violins", "maples", "comets", "tigers", "lanterns",
         "harbours", "pencils", "glaciers", "falcons"]
CODE = ("def {f}(items, limit):\n    result = []\n    for item in items:\n"
        "        if len(result) >= limit:\n            break\n        result.append(item)\n"
        "    return result\n")
PASSAGE = ("The {w} museum opened in {y}. Its first hall showed {a} from the northern coast, "
           "and visitors came from every town along the railway to see them. ")


def grounded_prompts(tokenizer) -> list[list[int]]:
    """16 chat prompts whose answers copy from the prompt: code, lists, passages."""
    texts = []
    for i in range(16):
        words = WORDS[i % 12:] + WORDS[:i % 12]
        if i % 3 == 0:
            texts.append(f"Rewrite this code with one change: rename `take_{i}` to `first_{i}`."
                         f"\n\n```python\n{CODE.format(f=f'take_{i}')}```")
        elif i % 3 == 1:
            texts.append(f"Repeat this list with one item changed: replace {words[2]} with "
                         f"stones.\n\n{', '.join(words[:9])}")
        else:
            texts.append("Summarise this passage by quoting it.\n\n" + PASSAGE.format(
                w=words[0], y=1900 + 7 * i, a=words[1]) * 2)
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True), add_special_tokens=False)
        for t in texts]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@dataclass
class Baseline:
    engine: LLMEngine  # without speculation
    prompts: list[list[int]]
    outputs: list[RequestOutput]


@pytest.fixture(scope="module")
def make(model_cache_dir, one_thread: None):
    def make(**kw) -> LLMEngine:
        config = dict(model="SmolLM2-135M-Instruct", model_cache_dir=str(model_cache_dir),
                      num_kv_blocks=320, max_num_batched_tokens=4096)
        config.update(kw)
        return LLMEngine(build(EngineConfig, **config))

    return make


@pytest.fixture(scope="module")
def plain(make) -> Baseline:
    engine = make()
    prompts = grounded_prompts(engine.tokenizer)
    return Baseline(engine, prompts, engine.generate(prompts, GREEDY))


@pytest.mark.parametrize("spec", [
    dict(speculative_method="ngram"),
    dict(speculative_method="draft", speculative_model="dummy:smollm2-draft-tiny"),
], ids=["ngram", "draft"])
def test_greedy_outputs_identical_to_plain(make, plain: Baseline, spec: dict) -> None:
    engine = make(**spec)
    outs = engine.generate(plain.prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain.outputs]
    assert [o.text for o in outs] == [o.text for o in plain.outputs]
    c = engine.spec_counters
    assert c.num_drafts > 0
    if spec["speculative_method"] == "ngram":
        assert c.num_accepted_tokens > 0.3 * c.num_draft_tokens
    # Only verified tokens were hashed: the prefix cache holds exactly plain decoding's blocks.
    assert set(engine.block_manager.cached) == set(plain.engine.block_manager.cached)
    assert engine.block_manager.num_used_blocks == 0


def test_stop_strings_apply_token_by_token(make, plain: Baseline) -> None:
    engine = make(speculative_method="ngram")
    i = 1  # a list prompt: long accepted runs
    text = plain.outputs[i].text
    cut = int(len(text) * 0.7)
    stop = text[cut:cut + 5]  # likely spans tokens; matched on the detokenized text
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[stop])
    want = plain.engine.generate([plain.prompts[i]], params)[0]
    got = engine.generate([plain.prompts[i]], params)[0]
    assert (got.text, got.output_token_ids, got.finish_reason) == (
        want.text, want.output_token_ids, "stop")
    assert engine.spec_counters.num_accepted_tokens > 0


def test_draft_equal_to_the_target_is_always_accepted(make, plain: Baseline) -> None:
    engine = make(speculative_method="draft", speculative_model="SmolLM2-135M-Instruct",
                  num_speculative_tokens=3)
    outs = engine.generate(plain.prompts[:2], GREEDY)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain.outputs[:2]]
    c = engine.spec_counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens
