"""CudaGraphRunner: the same tokens as ModelRunner, from persistent buffers and (on CUDA) graphs.

On the CPU the runner's buffer logic (staging, logit rows, the fallback for oversized steps) runs
eagerly against the torch backend, so its tokens must equal ModelRunner's exactly. The gpu-marked
tests compare graph replays with eager steps and the CPU on the same random weights.
"""

from __future__ import annotations

import random

import pytest
import torch

import common.engine.engine
from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.cuda_runner import CudaGraphRunner, decode_buckets, make_runner
from common.engine.engine import LLMEngine
from common.engine.model_runner import ModelRunner, gather_blocks, scatter_blocks
from common.flags import build

HAS_CUDA = torch.cuda.is_available()


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def test_make_runner_on_cpu_is_the_plain_runner(tmp_path):
    engine = LLMEngine(build(EngineConfig, model="dummy:tiny-llama", device="cpu", num_kv_blocks=8,
                                    model_cache_dir=str(tmp_path)))
    runner = make_runner(engine.model, engine.model_config, engine.config, engine.device,
                         engine.dtype, max_model_len=engine.max_model_len)
    assert type(runner) is ModelRunner


def _engine(runner_cls, tmp_path, **kw) -> LLMEngine:
    cfg = dict(model="dummy:tiny-llama", device="cpu", num_kv_blocks=64, block_size=4,
               max_num_seqs=4, max_num_batched_tokens=24, max_model_len=128,
               model_cache_dir=str(tmp_path))
    cfg.update(kw)
    return LLMEngine(build(EngineConfig, **cfg), runner_factory=runner_cls)


def _workload(n: int = 7) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(13)]  # a prefix some prompts share
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))]
        prompts.append(shared + tail if i % 2 else tail)
    params = [SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True)
              if i % 3 else SamplingParams(max_tokens=9, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def test_cpu_tokens_equal_model_runner(tmp_path):
    """Chunked prefill (budget 24), mixed steps, prefix hits, queueing past max_num_seqs, seeded
    sampling: token for token what ModelRunner gives."""
    prompts, params = _workload()
    want = _engine(ModelRunner, tmp_path).generate(prompts, params)
    engine = _engine(CudaGraphRunner, tmp_path)
    got = engine.generate(prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert any(o.num_cached_tokens for o in got)
    steps = engine.runner.steps
    assert steps["graph"] == 0 and steps["eager"] > 0 and steps["fallback"] == 0
    assert engine.block_manager.num_used_blocks == 0


def test_cpu_oversized_step_falls_back(tmp_path):
    """A step with more sequences than the buffers hold (prefilled requests join running
    without the max_num_seqs check) runs through ModelRunner.execute."""
    prompts, params = _workload(3)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 3
    want = _engine(ModelRunner, tmp_path).generate(prompts, params)
    engine = _engine(CudaGraphRunner, tmp_path, max_num_seqs=2, max_num_batched_tokens=64)
    runner = engine.runner
    assert runner.max_seqs == 2
    # Give the runner a third sequence mid-flight: start two, then add a prefilled third.
    source = _engine(ModelRunner, tmp_path)
    first = source.generate([prompts[2]], [SamplingParams(max_tokens=1, temperature=0.0,
                                                          ignore_eos=True)], hold_kv=True)[0]
    blocks = engine.kv.reserve(len(first.held_block_ids))
    engine.kv.import_(blocks, source.kv.export(first.held_block_ids))
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], params[i])
    engine.step()  # both prefill (eager)
    engine.add_request("r2", prompts[2], params[2], prefilled=common.engine.engine.Prefilled(
        blocks, first.output_token_ids[0]))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    assert [outs[f"r{i}"] for i in range(3)] == [o.output_token_ids for o in want]
    assert runner.steps["fallback"] > 0


# ---- KV handoff: export_kv / import_kv ---------------------------------------------------------

@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA,
                                                                          reason="needs CUDA")])])
def test_gather_and_scatter_blocks_match_index_select(device: str, use_kernel: bool):
    """The paths export_kv / import_kv take (the kernel one on CUDA; without CUDA it runs in
    Triton's interpreter): exactly index_select and index_copy_ on the block dimension."""
    if device == "cpu" and use_kernel and HAS_CUDA:
        pytest.skip("CUDA present: Triton compiles for it, the interpreter is off")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pool = torch.randn(3, 2, 11, 4, 2, 16, device=device).to(dtype)
    ids = [7, 0, 10, 3]
    index = torch.tensor(ids, device=device)
    kv = gather_blocks(pool, ids, use_kernel=use_kernel)
    assert kv.is_contiguous() and torch.equal(kv, pool.index_select(2, index))
    assert gather_blocks(pool, [], use_kernel=use_kernel).shape == (3, 2, 0, 4, 2, 16)

    new = torch.randn(kv.shape).to(dtype)  # on the host: import converts
    got, want = pool.clone(), pool.clone()
    scatter_blocks(got, ids, new, use_kernel=use_kernel)
    want.index_copy_(2, index, new.to(device))
    assert torch.equal(got, want)
    with pytest.raises((IndexError, RuntimeError)):  # torch's own errors, or ours
        gather_blocks(pool, [11], use_kernel=use_kernel)
    with pytest.raises((IndexError, ValueError)):
        scatter_blocks(got, ids[:3], new, use_kernel=use_kernel)


# ---- CUDA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["tiny-llama", "smollm2-135m"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graphs_match_eager_and_cpu(shape: str, tmp_path):
    """float32 on CUDA: graph replays give the eager steps' tokens, and the CPU's."""
    prompts, params = _workload()
    cfg = dict(model=f"dummy:{shape}", dtype="float32", block_size=16, num_kv_blocks=64,
               max_num_batched_tokens=64)
    # F.linear on the CPU: oneDNN would pack its weights in place, and they are copied below
    cpu_engine = _engine(ModelRunner, tmp_path, **cfg, cpu_linear="torch")
    cpu = cpu_engine.generate(prompts, params)
    graphs = _engine(CudaGraphRunner, tmp_path, device="cuda", **cfg)
    eager = _engine(lambda *a, **k: CudaGraphRunner(*a, **k, use_cuda_graphs=False), tmp_path,
                    device="cuda", **cfg)
    # Dummy weights are drawn on the parameters' device: give the CUDA models the CPU's. The
    # copy is in place, so the captured graphs keep reading the right addresses.
    for e in (graphs, eager):
        e.model.load_state_dict(cpu_engine.model.state_dict())
    assert sorted(graphs.runner.graphs) == [1, 2, 4]
    got = graphs.generate(prompts, params)
    got_eager = eager.generate(prompts, params)
    assert graphs.runner.steps["graph"] > 0 and eager.runner.steps["graph"] == 0
    # Greedy rows only: seeded sampling draws different noise on the two devices.
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [got[i].output_token_ids for i in greedy] == [cpu[i].output_token_ids for i in greedy]
    assert ([got[i].output_token_ids for i in greedy]
            == [got_eager[i].output_token_ids for i in greedy])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_bf16_uses_triton_ops_and_graphs(tmp_path):
    from common.models.ops_triton import TRITON_OPS
    engine = _engine(CudaGraphRunner, tmp_path, device="cuda", model="dummy:llama-3.2-1b",
                     dtype="bfloat16", block_size=16, num_kv_blocks=256, max_num_seqs=16,
                     max_num_batched_tokens=512, max_model_len=1024)
    assert engine.model.ops is TRITON_OPS and engine.runner.backend.name == "triton"
    assert sorted(engine.runner.graphs) == [1, 2, 4, 8, 16]
    prompts = [[random.Random(i).randrange(1000, 100000) for _ in range(100 + 37 * i)]
               for i in range(5)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                   ignore_eos=True))
    assert [len(o.output_token_ids) for o in outs] == [20] * 5
    assert engine.runner.steps["graph"] >= 15
