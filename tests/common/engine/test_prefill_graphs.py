"""CudaGraphRunner's graphs: the padding of prefill/mixed graphs (tokens and sequences) and of
decode graphs (one-token rows) gives the tokens of an unpadded step. On the CPU a stand-in "graph" re-runs the captured forward on each replay (the
Triton kernels run under the interpreter), which checks the staging and padding; the gpu-marked
tests in test_cuda_runner.py replay real graphs."""

from __future__ import annotations

import random

import pytest
import torch

import common.engine.cuda_runner
from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.cuda_runner import (
    CudaGraphRunner,
    _Graph,
    decode_buckets,
    prefill_buckets,
    prefill_graph_shapes,
)
from common.engine.engine import LLMEngine
from common.flags import build


def test_prefill_buckets():
    assert prefill_buckets(0) == []
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(1024) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert prefill_graph_shapes(100, 4) == [(16, 4), (32, 4), (64, 4), (100, 4)]
    assert prefill_graph_shapes(64, 256) == [(16, 16), (32, 16), (64, 16)]
    assert prefill_graph_shapes(512, 256)[-3:] == [(384, 256), (512, 16), (512, 256)]


class ForwardAgain:
    """Stands in for torch.cuda.CUDAGraph: replay() runs the forward again into the output."""

    def __init__(self, forward):
        self.forward = forward
        self.output = forward()
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.forward())
        self.replays += 1


def _engine(prefill_graphs: bool) -> LLMEngine:
    cfg = build(EngineConfig, model="dummy:tiny-llama", device="cpu", attention_backend="triton",
                       num_kv_blocks=64, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=24, max_model_len=128, overlap_scheduling="on")
    engine = LLMEngine(cfg, runner_factory=CudaGraphRunner)
    runner = engine.runner
    if prefill_graphs:
        for shape in prefill_graph_shapes(runner.max_tokens, runner.max_seqs):
            fake = ForwardAgain(lambda s=shape: runner._prefill_forward(*s, runner.backend))
            runner.prefill_graphs[shape] = _Graph(fake, fake.output)
    return engine


@pytest.mark.parametrize("few_seqs", [16, 2])  # one sequence bucket (max_num_seqs 4), or two
def test_padded_prefill_graphs_give_the_same_tokens(few_seqs: int, monkeypatch):
    monkeypatch.setattr(common.engine.cuda_runner, "PREFILL_GRAPH_FEW_SEQS", few_seqs)
    torch.set_num_threads(1)
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
               for i in range(6)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 8), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    want = _engine(False).generate(prompts, params)
    engine = _engine(True)
    got = engine.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    steps = engine.runner.steps
    assert steps["prefill_graph"] > 0 and steps["eager"] == 0
    assert len({seqs for _, seqs in engine.runner.prefill_graphs}) == (2 if few_seqs == 2 else 1)
    assert engine.block_manager.num_used_blocks == 0


def test_padded_decode_graphs_give_the_same_tokens():
    """Decode-only steps replay their bucket's graph: three sequences take the 4-row graph (one
    padding row: one token, slot -1, context 0), then 2 and 1; overlap scheduling's
    placeholders are copied into the graph's input ids on the device."""
    torch.set_num_threads(1)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 6, 4)]
    want = _engine(False).generate(prompts, params)
    engine = _engine(False)
    runner = engine.runner
    for bucket in decode_buckets(runner.max_seqs):
        fake = ForwardAgain(lambda b=bucket: runner._decode_forward(b, runner.backend))
        runner.graphs[bucket] = _Graph(fake, fake.output)
    got = engine.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert {b: g.graph.replays for b, g in runner.graphs.items()} == {4: 3, 2: 2, 1: 2}
    assert runner.steps["graph"] == 7 and runner.steps["fallback"] == 0
    assert engine.block_manager.num_used_blocks == 0
