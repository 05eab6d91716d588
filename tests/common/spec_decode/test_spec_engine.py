"""Speculative decoding through the in-process engine on dummy models (fast): exact equality with
plain decoding, hand-checked counters, stops inside accepted drafts, preemption, and the
distribution of sampled tokens with a draft model that disagrees often."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.engine.model_runner import step_tensors
from common.engine.step_input import StepRow, build_step_input
from common.flags import build
from tests.common.spec_decode.stats import fits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7], list(range(20, 60)),
           [100, 101, 102, 103] * 8, [300, 301, 302, 300, 301, 302, 300]]
pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NGRAM = dict(speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
SAME_DRAFT = dict(speculative_method="draft", speculative_model="dummy:tiny-llama")


def make(**kw) -> LLMEngine:
    config = dict(model="dummy:tiny-llama", num_kv_blocks=256, block_size=4)
    config.update(kw)
    return LLMEngine(build(EngineConfig, **config))


def check_released(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    proposer = engine.speculator.proposer if engine.speculator else None
    if hasattr(proposer, "block_manager"):
        assert proposer.block_manager.num_used_blocks == 0 and not proposer.states


@pytest.fixture(scope="module")
def plain(one_thread: None) -> list[list[int]]:
    return [o.output_token_ids for o in make().generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("spec", [NGRAM, SAME_DRAFT,
                                  dict(speculative_method="draft",
                                       speculative_model="dummy:vocab32-draft")],
                         ids=["ngram", "same-draft", "bad-vocab"])
def test_greedy_outputs_are_unchanged(plain: list[list[int]], spec: dict) -> None:
    if spec.get("speculative_model") == "dummy:vocab32-draft":
        with pytest.raises(ValueError, match="vocabulary size 32"):
            make(**spec)
        return
    engine = make(**spec)
    assert [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
    assert engine.spec_counters.num_accepted_tokens > 0
    check_released(engine)


def test_counters_hand_checked() -> None:
    # Draft == target (same dummy weights): every draft is accepted. With k = 4 and
    # max_tokens = 11, a request samples 1 token at prefill, then drafts min(4, 11 - n - 1)
    # with n outputs: 4 (n = 1 -> 6), 4 (n = 6 -> 11). Three requests.
    engine = make(**SAME_DRAFT, num_speculative_tokens=4)
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    outs = engine.generate(PROMPTS[:3], params)
    assert all(len(o.output_token_ids) == 11 for o in outs)
    c = engine.spec_counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (6, 24, 24)
    assert c.accepted_per_position == [6, 6, 6, 6]
    # n-gram on a prompt the dummy model does not continue: a hand-checked first proposal.
    engine = make(**NGRAM, num_speculative_tokens=3)
    seq_params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("r", [7, 8, 9, 7, 8], seq_params)
    engine.step()  # prefill samples t; then "7 8 9 7 8 t": drafts follow the latest match
    seq = engine.seqs["r"]
    t = seq.output_token_ids[0]
    expected = {7: [8, 9, 7], 8: [9, 7, 8], 9: [7, 8, t]}.get(t, [])
    engine.speculator.propose(engine.scheduler.running)
    assert seq.spec_token_ids == expected[:1]  # max_tokens 2: one more token, one draft


def test_opt_out_penalties_and_logprobs_share_the_batch(plain: list[list[int]]) -> None:
    engine = make(**NGRAM)
    params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                     speculative=False),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             repetition_penalty=1.0)]
    outs = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for o in outs] == plain
    assert len(outs[2].logprobs) == 40
    check_released(engine)


def test_stop_inside_accepted_drafts_discards_the_rest(plain: list[list[int]]) -> None:
    engine = make(**SAME_DRAFT)
    want = plain[1]
    stop = want[7]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            stop_token_ids=[stop])
    out = engine.generate([PROMPTS[1]], params)[0]
    assert out.output_token_ids == want[:want.index(stop) + 1]
    assert out.finish_reason == "stop"
    check_released(engine)


def test_preemption_and_chunked_draft_catch_up(plain: list[list[int]]) -> None:
    # 30 blocks of 4 cannot hold four 80-token sequences: some are preempted and recomputed;
    # a 16-token budget chunks the draft's catch-up on the prompts.
    for spec in (NGRAM, SAME_DRAFT):
        engine = make(**spec, num_kv_blocks=30, max_num_batched_tokens=16)
        assert [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)] == plain
        assert engine.scheduler.num_preemptions > 0
        check_released(engine)


def test_seeded_sampling_is_unchanged_by_ngram_and_deterministic_with_a_draft() -> None:
    params = [SamplingParams(max_tokens=30, temperature=t, top_k=k, seed=s, min_tokens=3)
              for t, k, s in [(0.3, -1, 1), (0.5, 20, 2), (0.2, -1, 3), (0.4, 50, 4)]]
    want = [o.output_token_ids for o in make().generate(PROMPTS, params)]
    assert [o.output_token_ids for o in make(**NGRAM).generate(PROMPTS, params)] == want
    engine = make(**SAME_DRAFT)
    first = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
    assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == first


def _next_token_probs(engine: LLMEngine, contexts: list[list[int]]) -> torch.Tensor:
    """Exact p(next | context) under the target at temperature 1: one prefill of every context
    on blocks borrowed from the engine's pool."""
    bs = engine.config.cache.block_size
    tables = [engine.block_manager.allocate_blocks(-(-len(c) // bs)) for c in contexts]
    try:
        rows = [StepRow(c, 0, t) for c, t in zip(contexts, tables, strict=True)]
        ids, pos, meta = step_tensors(build_step_input(rows, bs), engine.device)
        with torch.inference_mode():
            hidden = engine.runner.model(ids, pos, engine.kv_cache, meta, engine.runner.backend)
            last = meta.query_start_loc[1:].long() - 1
            return engine.runner.model.compute_logits(hidden[last]).softmax(dim=-1)
    finally:
        for table in tables:
            engine.block_manager.unref_blocks(table)


def test_sampling_with_a_disagreeing_draft_preserves_the_target_distribution() -> None:
    engine = make(model="dummy:vocab32", speculative_method="draft",
                  speculative_model="dummy:vocab32-draft", num_speculative_tokens=3,
                  num_kv_blocks=4096, max_num_seqs=512)
    # Sharpen both (random, unrelated) models' output layers: top probabilities around 0.3.
    with torch.no_grad():
        engine.model.lm_head.weight.mul_(10.0)
        engine.speculator.proposer.model.lm_head.weight.mul_(10.0)
    prompt = [3, 17, 9, 25, 11]
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)
    samples = [o.output_token_ids for o in engine.generate([prompt] * 4000, params)]
    c = engine.spec_counters
    assert c.num_accepted_tokens < 0.3 * c.num_draft_tokens  # the draft disagrees often
    assert min(c.accepted_per_position) > 0
    # Exact marginals of output tokens 2 and 3 (token 1 comes from the prefill).
    p1 = _next_token_probs(engine, [prompt])[0]
    joint12 = p1[:, None] * _next_token_probs(engine, [prompt + [a] for a in range(32)])
    pairs = [(a, b) for a in range(32) for b in range(32)]
    p3 = _next_token_probs(engine, [prompt + [a, b] for a, b in pairs])
    marginal3 = (joint12.reshape(-1, 1) * p3).sum(dim=0)
    for j, marginal in ((1, joint12.sum(dim=0)), (2, marginal3)):
        assert fits([s[j] for s in samples], dict(enumerate(marginal.tolist()))), j
    check_released(engine)


@pytest.mark.parametrize("spec", [NGRAM, SAME_DRAFT], ids=["ngram", "draft"])
def test_handoff_decode_side_speculates_from_imported_kv(plain: list[list[int]],
                                                         spec: dict) -> None:
    """The prompt's KV comes from a prefill engine; the draft's prompt KV is computed here."""
    import dataclasses

    from common.engine.engine import Prefilled
    prefill, decode = make(), make(**spec)
    for i, prompt in enumerate(PROMPTS):
        first = prefill.generate([prompt], dataclasses.replace(GREEDY, max_tokens=1),
                                 hold_kv=True)[0]
        held = first.held_block_ids
        blocks = decode.kv.reserve(len(held))
        decode.kv.import_(blocks, prefill.kv.export(held))
        prefill.kv.release(first.request_id)
        decode.add_request(f"h{i}", prompt, GREEDY,
                           prefilled=Prefilled(blocks, first.output_token_ids[0]))
    outs: dict[str, list[int]] = {}
    while decode.has_unfinished():
        for o in decode.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    assert [outs[f"h{i}"] for i in range(len(PROMPTS))] == plain
    assert decode.spec_counters.num_accepted_tokens > 0
    check_released(decode)
    check_released(prefill)
