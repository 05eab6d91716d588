"""Overlap scheduling (step N+1 scheduled and launched before step N's tokens reach the host)
gives exactly the outputs of the synchronous engine, frees every block, and handles aborts."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.cuda_runner import CudaGraphRunner
from common.engine.engine import LLMEngine
from common.engine.model_runner import ModelRunner
from common.flags import build

MODEL = "dummy:tiny-llama"  # 512-token vocabulary


def make_engine(overlap: str, runner=ModelRunner, **kw) -> LLMEngine:
    cfg = dict(model=MODEL, device="cpu", max_num_seqs=8, max_num_batched_tokens=64,
               max_model_len=512, num_kv_blocks=400, overlap_scheduling=overlap)
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg), runner_factory=runner)


def workload(n: int = 20, shared_prefix: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy, seeded, stop-token, penalised and logprobs requests of mixed lengths."""
    rnd = random.Random(0)
    prefix = [rnd.randrange(512) for _ in range(shared_prefix)]
    prompts, params = [], []
    for i in range(n):
        prompts.append(prefix + [rnd.randrange(512) for _ in range(rnd.randrange(5, 120))])
        kw: dict = dict(max_tokens=rnd.randrange(1, 50), temperature=0.0)
        if i % 3 == 1:
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        if i % 4 == 2:
            kw.update(stop_token_ids=[rnd.randrange(512) for _ in range(40)])
        if i % 5 == 3:
            kw.update(frequency_penalty=0.5, presence_penalty=0.2)
        if i % 6 == 4:
            kw.update(logprobs=2)
        if i % 7 == 5:
            kw.update(min_tokens=3)
        params.append(SamplingParams(**kw))
    return prompts, params


def outputs(engine: LLMEngine, prompts, params) -> list[tuple]:
    """Tokens, finish reasons and logprobs (rounded: batches of other sizes may move the last
    bits of a float32 logit)."""
    result = [(o.output_token_ids, o.finish_reason,
               [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top])
                for lp in o.logprobs or []])
              for o in engine.generate(prompts, params)]
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    return result


@pytest.mark.parametrize("runner", [ModelRunner, CudaGraphRunner])
@pytest.mark.parametrize("pool", [
    dict(num_kv_blocks=400, enable_prefix_caching=False),
    dict(num_kv_blocks=40),                         # preemption
    dict(num_kv_blocks=400, shared_prefix=48),      # prefix-cache hits
])
def test_overlap_matches_synchronous(runner, pool):
    torch.set_num_threads(1)
    pool = dict(pool)
    prompts, params = workload(shared_prefix=pool.pop("shared_prefix", 0))
    expected = outputs(make_engine("off", runner, **pool), prompts, params)
    engine = make_engine("on", runner, **pool)
    assert engine.overlap
    assert outputs(engine, prompts, params) == expected
    assert sum(1 for out, _, _ in expected if out) == len(prompts)


def test_placeholder_in_flight_then_resolved():
    engine = make_engine("on")
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=5, temperature=0.0))
    assert engine.step() == []  # the prefill is in flight: no outputs yet
    seq = engine.seqs["a"]
    assert seq.token_ids[-1] == -1  # row 0 of the launched step's tokens
    assert engine.has_unfinished()
    outs = engine.step()  # launches the first decode, then finishes the prefill
    assert [o.new_token_ids for o in outs] == [[seq.output_token_ids[0]]]
    assert seq.output_token_ids[0] >= 0 and seq.token_ids[-1] == -1
    tokens = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
    assert len(tokens) == 4 and min(tokens) >= 0
    assert engine.block_manager.num_used_blocks == 0


def test_abort_while_in_flight_frees_everything():
    engine = make_engine("on")
    params = SamplingParams(max_tokens=40, temperature=0.0)
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * 30, params)
    for _ in range(5):
        engine.step()
    assert engine.abort("r1") and engine.abort("r2")
    finished = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id not in ("r1", "r2")
            if o.finished:
                finished[o.request_id] = o
    assert set(finished) == {"r0", "r3"}
    assert all(len(o.output_token_ids) == 40 for o in finished.values())
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_a_copy_waits_for_the_step_in_flight_only_when_it_may_write_free_blocks():
    """Blocks reserved for a handoff copy can be written by the step in flight only through a
    sequence that ended after that step was launched (its blocks are free then)."""
    engine = make_engine("on")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    assert not engine.step_in_flight_may_write_free_blocks()  # nothing launched
    engine.add_request("short", [5] * 20, SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request("long", [6] * 20, params)
    engine.step()  # both prefills in flight, nobody has ended
    assert not engine.step_in_flight_may_write_free_blocks()
    blocks, after = engine.kv.reserve_for_copy(2)
    assert len(blocks) == 2 and after is None  # on CPU never an event
    engine.kv.free(blocks)
    engine.step()  # "short" ends with the prefill's token, "long" decodes in the launched step
    assert engine.seqs.get("short") is None
    assert not engine.step_in_flight_may_write_free_blocks()  # "short" had no row in it
    assert engine.abort("long")  # "long" has a row in the step in flight: its blocks are free
    assert engine.step_in_flight_may_write_free_blocks()
    while engine.has_unfinished():
        engine.step()
    assert not engine.step_in_flight_may_write_free_blocks()
    assert engine.block_manager.num_used_blocks == 0


def test_overlap_auto_is_off_on_cpu_and_with_speculation():
    assert not make_engine("auto").overlap
    assert not make_engine("on", speculative_method="ngram").overlap
    with pytest.raises(ValueError, match="overlap_scheduling"):
        build(EngineConfig, overlap_scheduling="sometimes")


def test_each_output_keeps_the_tokens_it_was_made_with():
    """RequestOutput.output_token_ids reads the sequence's own (growing) list up to its count:
    an output kept while later steps append, and resolve placeholders, still gives its own
    tokens, the running sum of new_token_ids."""
    engine = make_engine("on")
    prompts, params = workload(6)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    kept = []
    while engine.has_unfinished():
        kept += engine.step()
    seen: dict[str, list[int]] = {}
    for out in kept:
        seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.output_token_ids == seen[out.request_id]
        assert all(t >= 0 for t in out.output_token_ids)
