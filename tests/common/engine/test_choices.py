"""n > 1 in the engine on SmolLM2-135M (CPU, float32): the prompt computed once, its full blocks
shared by the choices (exact ref counts), each choice drawing with seed + i exactly as a request
of its own with that seed does, greedy choices identical, every block back in the pool when the
choices finish or the request is aborted; the same after a handoff (Prefilled)."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine, Prefilled, RequestOutput
from common.flags import build

BLOCK = 16


@pytest.fixture(scope="module")
def engines(model_cache_dir):
    def make() -> LLMEngine:
        return LLMEngine(build(EngineConfig, model="SmolLM2-135M-Instruct", device="cpu",
                               model_cache_dir=str(model_cache_dir), num_kv_blocks=128,
                               block_size=BLOCK, cpu_threads=2))
    upstream, here = make(), make()
    yield upstream, here
    for engine in (upstream, here):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.block_manager.check_invariants()


@pytest.fixture(scope="module")
def prompt(engines) -> list[int]:
    ids = engines[1].tokenizer.encode(
        "Write a short poem about the sea, the wind and a small boat that sails at night. "
        "Make it rhyme, keep it to four lines, and end it with the word harbour.")
    assert len(ids) % BLOCK and len(ids) > 2 * BLOCK  # two full blocks and a partial one
    return ids


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
        prefilled: Prefilled | None = None) -> tuple[dict[int, list[int]], list[RequestOutput]]:
    """Every choice's tokens by index, and the outputs in order."""
    engine.add_request(rid, prompt, params, prefilled=prefilled)
    tokens: dict[int, list[int]] = {}
    outs = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
            outs.append(out)
    return tokens, outs


def test_greedy_choices_are_identical(engines, prompt):
    _, engine = engines
    alone, _ = run(engine, "one", prompt, SamplingParams(max_tokens=10, temperature=0.0))
    got, outs = run(engine, "three", prompt, SamplingParams(max_tokens=10, temperature=0.0, n=3))
    assert sorted(got) == [0, 1, 2]
    assert got[0] == got[1] == got[2] == alone[0]
    finished = [o for o in outs if o.finished]
    assert sorted(o.index for o in finished) == [0, 1, 2]
    assert [o.last for o in outs] == [False] * (len(outs) - 1) + [True]


def test_seeded_choices_draw_like_requests_of_their_own(engines, prompt):
    _, engine = engines
    sampling = dict(max_tokens=12, temperature=0.9, top_p=0.95)
    got, _ = run(engine, "n3", prompt, SamplingParams(seed=500, n=3, **sampling))
    for i in range(3):
        alone, _ = run(engine, f"alone{i}", prompt, SamplingParams(seed=500 + i, **sampling))
        assert got[i] == alone[0], f"choice {i}"
    assert len({tuple(t) for t in got.values()}) == 3  # three different seeds, three answers


def test_blocks_shared_then_freed(engines, prompt):
    _, engine = engines
    bm = engine.block_manager
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3, ignore_eos=True)
    engine.add_request("shared", prompt, params)
    engine.step()  # the prompt, once: choice 0's first token, then the fork
    parent = engine.seqs["shared"]
    full = len(prompt) // BLOCK
    children = [engine.seqs[f"shared#{i}"] for i in (1, 2)]
    for c in children:
        assert c.block_table == parent.block_table[:full]
        assert c.num_computed_tokens == full * BLOCK
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3] * full + [1]
    engine.step()  # the children compute the partial block into blocks of their own
    assert len({c.block_table[full] for c in children} | {parent.block_table[full]}) == 3
    while engine.has_unfinished():
        engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_frees_every_choice(engines, prompt):
    _, engine = engines
    bm = engine.block_manager
    engine.add_request("gone", prompt, SamplingParams(max_tokens=50, n=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert {"gone", "gone#1", "gone#2", "gone#3"} <= set(engine.seqs)
    assert engine.abort("gone")
    assert not engine.seqs and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


@pytest.mark.parametrize("first_ends", [False, True], ids=["continues", "first-token-ends"])
def test_prefilled_request_forks_from_the_handed_over_blocks(engines, prompt, first_ends):
    """The decode side's case: the KV and choice 0's first token come from upstream; the other
    choices share the delivered blocks and draw their own first tokens (seed + i)."""
    upstream, here = engines
    max_tokens = 1 if first_ends else 8
    params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=77, n=3)
    whole, _ = run(upstream, "whole", prompt, params)
    held_params = SamplingParams(max_tokens=1, temperature=0.9, seed=77)
    upstream.add_request("held", prompt, held_params, hold_kv=True)
    while upstream.has_unfinished():
        for out in upstream.step():
            held = out
    assert held.output_token_ids == whole[0][:1]
    blocks = here.kv.reserve(len(held.held_block_ids))
    here.kv.import_(blocks, upstream.kv.export(held.held_block_ids))
    upstream.kv.release("held")
    got, outs = run(here, "cont", prompt, params, Prefilled(blocks, held.output_token_ids[0]))
    assert got.get(0, []) == whole[0][1:]  # choice 0's first token was upstream's output
    assert got[1] == whole[1] and got[2] == whole[2]
    assert [len(got.get(i, [])) for i in (1, 2)] == [max_tokens] * 2
    assert outs[-1].last and sum(o.finished for o in outs) == 3
