"""CudaGraphRunner's prefill/mixed graphs: token and sequence padding give the tokens of an
unpadded step. On the CPU a stand-in "graph" re-runs the captured forward on each replay (the
Triton kernels run under the interpreter), which checks the staging and padding; the gpu-marked
tests in test_cuda_runner.py replay real graphs."""

from __future__ import annotations

import random

import pytest
import torch

import common.engine.cuda_runner
from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.cuda_runner import CudaGraphRunner, _Graph, prefill_buckets, prefill_graph_shapes
from common.engine.engine import LLMEngine


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

    def replay(self) -> None:
        self.output.copy_(self.forward())


def _engine(prefill_graphs: bool) -> LLMEngine:
    cfg = EngineConfig(model="dummy:tiny-llama", device="cpu", attention_backend="triton",
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
