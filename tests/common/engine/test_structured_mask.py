"""The structured-output mask's batched path (common/engine/structured.py, issue 24's CPU target):
the CPU apply's bitwise ops against a plain-torch reference and xgrammar's own kernel, one batched
fill against each matcher's own, a dead end among other rows, and generate() waiting for a
compile instead of stepping in a loop."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.engine.engine import LLMEngine
from common.engine.structured import GrammarCache, GrammarState, TokenMasker, apply_bitmask_cpu
from common.flags import build
from common.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"]}
DOCUMENT = '{"name": "Ada", "tags": ["math", "engines"]}'


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Plain torch, token by token: t is allowed where bit t % 32 of word t // 32 is set."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab)
    words = bitmask[:, tokens // 32].long() & 0xFFFFFFFF
    allowed = (words >> (tokens % 32)) & 1 == 1
    return logits.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize(("rows", "vocab"), [(1, 6), (3, 33), (5, 100), (32, 49152)])
def test_cpu_apply_equals_the_reference_and_xgrammars_kernel(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bitmask[0] = 0  # nothing allowed
    bitmask[-1, 0] = -1  # a whole word allowed, its sign bit included
    logits = torch.randn(rows, vocab, generator=gen)
    logits[0, 0], logits[-1, -1], logits[-1, 0] = float("inf"), float("-inf"), -0.0
    want = reference_apply(logits, bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    got = logits.clone()
    scratch = apply_bitmask_cpu(got, bitmask)
    assert torch.equal(got, want) and torch.equal(theirs, want)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 kept, bit for bit
    again = logits.clone()
    assert apply_bitmask_cpu(again, bitmask, scratch) is scratch  # kept across calls
    assert torch.equal(again, want)


def test_cpu_apply_refuses_what_it_cannot_mask():
    with pytest.raises(ValueError, match="do not match"):
        apply_bitmask_cpu(torch.zeros(2, 64, dtype=torch.bfloat16),
                          torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        apply_bitmask_cpu(torch.zeros(2, 64)[:, ::2], torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        apply_bitmask_cpu(torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32))


@pytest.fixture(scope="module")
def json_states(smollm2_dir) -> tuple[Tokenizer, list[GrammarState]]:
    """Eight matchers of one schema, each some tokens further into DOCUMENT (inside strings,
    between keys, in the array, complete)."""
    tok = Tokenizer.from_dir(smollm2_dir)
    cache = GrammarCache(tok, 49152, tok.eos_token_ids)
    future = cache.get(StructuredOutput("json", json.dumps(SCHEMA)))
    future.result(timeout=120)
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    states = []
    for i in range(8):
        state = GrammarState(future, tok.eos_token_ids)
        assert state.activate(ids[:i * len(ids) // 7])
        states.append(state)
    cache.close()
    return tok, states


def test_batched_fill_and_apply_equal_each_matchers_own(json_states):
    _, states = json_states
    rows = [0, 2, 3, 5, 6, 7, 9, 10]  # rows 1, 4, 8 unconstrained
    logits = torch.randn(11, 49152, generator=torch.Generator().manual_seed(0))
    own = []  # each matcher's own bitmask
    for state in states:
        one = xgr.allocate_token_bitmask(1, 49152)
        state.matcher.fill_next_token_bitmask(one)
        own.append(one)
    want = logits.clone()
    for row, mask in zip(rows, own, strict=True):
        want[row:row + 1] = reference_apply(want[row:row + 1], mask)
    masker = TokenMasker()
    for _ in range(2):  # the second call reuses the host buffer and the scratch
        got = logits.clone()
        masker.apply(got, rows, states)
        assert torch.equal(got, want)
    got = logits.clone()
    masker.apply(got, list(range(8)), states)  # every row constrained: masked in place
    assert torch.equal(got[:8], reference_apply(logits[:8], torch.cat(own)))
    assert torch.equal(got[8:], logits[8:])


VOCAB = ["a", "b", "c", "ab", "</s>", "x"]
STOP = 4


def tiny_state(regex: str) -> GrammarState:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB),
                             stop_token_ids=[STOP])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    future: Future = Future()
    future.set_result(compiler.compile_regex(regex))
    state = GrammarState(future, (STOP,))
    assert state.activate([])
    return state


def test_a_dead_end_among_other_rows_allows_only_its_stop_token():
    states = [tiny_state("c+"), tiny_state("z"), tiny_state("(a|b)+")]
    logits = torch.zeros(3, len(VOCAB))
    TokenMasker().apply(logits, [0, 1, 2], states)
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[2], [STOP], [0, 1, 3]]


def test_generate_waits_for_a_compile_instead_of_stepping(model_cache_dir, monkeypatch):
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir),
                             num_kv_blocks=64))
    real_get = engine.grammars.get

    def slow_get(spec, on_done=None):  # the compile finishes 0.5 s after the request is added
        compiled = real_get(spec).result(timeout=120)
        future: Future = Future()
        threading.Timer(0.5, future.set_result, (compiled,)).start()
        if on_done is not None:
            future.add_done_callback(lambda _f: on_done())
        return future

    monkeypatch.setattr(engine.grammars, "get", slow_get)
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(engine, "step", counted_step)
    out = engine.generate([[1, 2, 3]], SamplingParams(
        max_tokens=4, temperature=0.0, structured=StructuredOutput("regex", "[0-9]{4}")))[0]
    assert out.finish_reason in ("stop", "length") and out.text.isdigit()
    assert steps <= 4 + 3  # the decode steps and a few around the compile, not thousands
