"""The model and the torch backend on CUDA give the CPU's answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.models.loader import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape", ["tiny-llama", "qwen2.5-0.5b"])
def test_cuda_float32_matches_cpu(shape: str, tmp_path: Path, paged_runner):
    cpu, _ = load_model(f"dummy:{shape}", dtype=torch.float32, device=torch.device("cpu"),
                        cache_dir=tmp_path)
    gpu, _ = load_model(f"dummy:{shape}", dtype=torch.float32, device=torch.device("cuda"),
                        cache_dir=tmp_path)
    gpu.load_state_dict(cpu.state_dict())
    prompts = [list(range(3, 40)), list(range(100, 117))]
    results = []
    for model in (cpu, gpu):
        runner = paged_runner(model)
        out = runner.step(list(enumerate(prompts)))
        out += runner.step([(0, [7]), (1, [9])])
        results.append(torch.cat(out).cpu())
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)


def test_cuda_bfloat16_runs_the_real_shape(tmp_path: Path, paged_runner):
    model, config = load_model("dummy:llama-3.2-1b", dtype=torch.bfloat16,
                               device=torch.device("cuda"), cache_dir=tmp_path)
    runner = paged_runner(model, num_blocks=32, block_size=16)
    (prefill,) = runner.step([(0, list(range(1, 200)))])
    (decode,) = runner.step([(0, [5])])
    assert prefill.shape == (199, config.vocab_size) and decode.shape == (1, config.vocab_size)
    assert prefill.dtype == torch.float32 and bool(torch.isfinite(prefill).all())
