"""Requests whose first token was sampled upstream (Prefilled): with the prompt's KV handed over,
or recomputed here after a failed handoff, they continue exactly as the whole request would have
run in one engine: tokens, text, stop strings that span the first token, seeded draws."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, Prefilled
from common.flags import build


@pytest.fixture(scope="module")
def engines(model_cache_dir):
    def make() -> LLMEngine:
        return LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct", device="cpu",
                                      model_cache_dir=str(model_cache_dir), num_kv_blocks=256,
                                      cpu_threads=2))
    upstream, here = make(), make()
    yield upstream, here
    for engine in (upstream, here):
        assert engine.block_manager.num_used_blocks == 0


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
        prefilled: Prefilled | None = None, hold_kv: bool = False):
    engine.add_request(rid, prompt, params, prefilled=prefilled, hold_kv=hold_kv)
    final, text = None, ""
    while engine.has_unfinished():
        for out in engine.step():
            text += out.new_text
            if out.finished:
                final = out
    return final, text


@pytest.mark.parametrize("handed_over", [True, False], ids=["kv-handed-over", "kv-recomputed"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0),
                                      dict(temperature=0.9, seed=11, frequency_penalty=0.4)])
def test_continues_like_one_engine(engines, handed_over: bool, sampling: dict):
    upstream, here = engines
    prompt = here.tokenizer.encode("The three primary colours of light are")
    whole, _ = run(upstream, "whole", prompt, SamplingParams(max_tokens=12, **sampling))
    first = whole.output_token_ids[0]
    blocks = None
    if handed_over:
        held, _ = run(upstream, "held", prompt, SamplingParams(max_tokens=1, **sampling),
                      hold_kv=True)
        assert held.output_token_ids == [first]
        blocks = here.kv.reserve(len(held.held_block_ids))
        here.kv.import_(blocks, upstream.kv.export(held.held_block_ids))
        upstream.kv.release("held")
    got, _ = run(here, "cont", prompt, SamplingParams(max_tokens=12, **sampling),
                 Prefilled(blocks, first))
    assert got.output_token_ids == whole.output_token_ids
    assert got.text == whole.text


def test_stop_string_across_the_first_token(engines):
    """The matcher sees the first token's text: a stop string that starts inside it and ends in
    the second token stops the request, as it does in one engine."""
    upstream, here = engines
    prompt = here.tokenizer.encode("Count from one to ten: one, two,")
    plain, _ = run(upstream, "plain", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    texts = [here.tokenizer.decode(plain.output_token_ids[:n]) for n in (1, 2)]
    stop = texts[1][len(texts[0]) - 1:len(texts[0]) + 1]  # last char of 1st + first of 2nd
    assert len(stop) == 2
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=[stop])
    whole, _ = run(upstream, "whole", prompt, params)
    got, _ = run(here, "cont", prompt, params, Prefilled(None, plain.output_token_ids[0]))
    assert whole.finish_reason == got.finish_reason == "stop"
    assert got.output_token_ids == whole.output_token_ids
    assert got.text == whole.text


def test_first_token_that_ends_the_request(engines):
    _, here = engines
    prompt = here.tokenizer.encode("Hello")
    eos = here.eos_token_ids[0]
    for blocks in (None, here.kv.reserve(1)):
        here.add_request("ends", prompt, SamplingParams(max_tokens=5, temperature=0.0),
                         prefilled=Prefilled(blocks, eos))
        outs = here.step()
        assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [
            ("ends", True, "stop")]
        assert not here.has_unfinished()
