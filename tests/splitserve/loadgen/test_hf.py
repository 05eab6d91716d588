"""The HF transformers peer on a small workload of the real model. (The gRPC and HTTP backends
run against a live stack in tests/stack/test_observability.py.)"""

from __future__ import annotations

from splitserve.loadgen import datasets
from splitserve.loadgen.hf import run_hf


def test_hf_backend_on_a_small_workload(smollm2_dir):
    work = datasets.random_lengths(3, 8, 3, 0.5, vocab_size=49152, seed=0)
    results, duration = run_hf(smollm2_dir, work, batch_size=2, progress=False)
    assert [r.output_len for r in results] == [r.max_tokens for r in work]
    assert all(len(r.itl) == r.output_len - 1 for r in results)
    assert all(r.ok and 0 < r.ttft <= r.e2e <= duration for r in results)
    assert results[2].start >= results[0].e2e  # the second batch starts after the first
