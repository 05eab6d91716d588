"""The structured-output mask on CUDA (common/engine/structured.py): the same allowed tokens as the
CPU path for every constrained row, unconstrained rows untouched, no implicit host sync in the
mask's launch, and the sampler's picks inside the grammar. Skipped without CUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.engine.core.sequence import Sequence
from common.engine.sampler import Sampler
from common.engine.structured import GrammarCache, GrammarState, TokenMasker
from common.text.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def tokenizer_dir() -> Path:
    if "SPLITSERVE_TOKENIZER_DIR" in os.environ:  # a GPU box without the converted model
        return Path(os.environ["SPLITSERVE_TOKENIZER_DIR"])
    from common.engine.config import DEFAULT_CACHE_DIR
    from common.models.loader import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL, DEFAULT_CACHE_DIR)


@pytest.fixture(scope="module")
def states() -> tuple[Tokenizer, list[GrammarState]]:
    tok = Tokenizer.from_dir(tokenizer_dir())
    cache = GrammarCache(tok, 49152, tok.eos_token_ids)
    specs = [StructuredOutput("json", json.dumps(SCHEMA)), StructuredOutput("regex", "[0-9]+"),
             StructuredOutput("choice", choices=("yes", "no"))]
    out = []
    for spec in specs:
        state = GrammarState(cache.get(spec), tok.eos_token_ids)
        state.future.result(timeout=60)
        state.activate([])
        out.append(state)
    out[0].accept(tok.encode("{", add_special_tokens=False)[0])
    return tok, out


def test_cuda_mask_equals_cpu_mask(states):
    _, grammar = states
    rows = [0, 2, 5]
    logits = torch.randn(6, 49152)
    cpu = logits.clone()
    TokenMasker().apply(cpu, rows, grammar)
    gpu = logits.cuda()
    masker = TokenMasker()
    torch.cuda.set_sync_debug_mode("error")  # an implicit host sync raises
    try:
        for _ in range(3):  # both pinned buffers, then the first again
            masker.apply(gpu, rows, grammar)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(cpu[[1, 3, 4]], logits[[1, 3, 4]])
    assert torch.isinf(cpu[0]).sum() > 49000  # '{' then only '"' or '}' (and their variants)


def test_cuda_sampler_picks_inside_the_grammar(states):
    tok, grammar = states
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=t, seed=i))
            for i, t in enumerate((0.0, 1.0, 0.0, 0.7))]
    seqs[1].grammar, seqs[2].grammar = grammar[1], grammar[2]
    logits = torch.randn(4, 49152, device="cuda", dtype=torch.bfloat16)
    tokens = Sampler()(logits, seqs).token_ids
    assert tok.decode([tokens[1]]).isdigit()
    assert tok.decode([tokens[2]]) in ("y", "ye", "yes", "n", "no")
    assert tokens[0] == int(logits[0].float().argmax())
