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


def test_overlap_samples_constrained_rows_every_step(states):
    """The CUDA-graph runner with overlap scheduling (CUDA's default): constrained rows take
    placeholders and their steps' sampling waits for the matchers (PendingStep's deferred
    sampling), so each constrained request samples at every step, and the tokens equal the
    synchronous engine's (random weights of SmolLM2's vocabulary; the grammar, not the model,
    shapes the text)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.flags import build

    tok, _ = states
    specs = [StructuredOutput("json", json.dumps(SCHEMA)), StructuredOutput("regex", "[0-9]{4,40}")]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured=specs[0]),
              SamplingParams(max_tokens=32, temperature=0.0),
              SamplingParams(max_tokens=36, temperature=0.8, seed=3, structured=specs[1])]
    prompts = [[1 + 7 * i + j for j in range(20 + 5 * i)] for i in range(len(params))]
    results, launches = [], []
    for overlap in ("off", "on"):
        e = LLMEngine(build(EngineConfig, model="dummy:smollm2-draft-tiny", device="cuda",
                            dtype="float32", max_num_seqs=8, max_num_batched_tokens=128,
                            max_model_len=512, num_kv_blocks=64, overlap_scheduling=overlap))
        e.tokenizer = tok
        e.grammars = GrammarCache(tok, e.model_config.vocab_size, tok.eos_token_ids)
        for spec in specs:
            e.grammars.get(spec).result(timeout=60)
        before = sum(e.runner.steps.values())
        results.append(e.generate(prompts, params))
        launches.append(sum(e.runner.steps.values()) - before)
        assert e.block_manager.num_used_blocks == 0
    sync, overlapped = results
    assert [o.output_token_ids for o in overlapped] == [o.output_token_ids for o in sync]
    assert [o.finish_reason for o in overlapped] == [o.finish_reason for o in sync]
    longest = max(len(o.output_token_ids) for o in sync)
    assert launches[1] <= longest + 1, launches
