"""kernels.extend_attention against torch_ops.paged_attention_extend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels import torch_ops
from kernels.extend_attention import ExtendConfig, paged_attention_extend

F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]     # new tokens per sequence
    prefixes: tuple[int, ...]   # cached tokens before them
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = F32
    block_m: int = 16
    block_n: int = 16


def _cpu(case: Case, name: str):
    return pytest.param("cpu", case, id=f"cpu-{name}")


def _gpu(case: Case, name: str):
    return pytest.param("cuda", case, id=f"cuda-{name}", marks=pytest.mark.gpu)


# Mixed batches: plain prefill (prefix 0), chunked prefill / prefix hit (prefix > 0),
# speculative verification (a few tokens after a long prefix), a single-token context, and a
# sequence with no new tokens.
CASES = [
    _cpu(Case((5, 1, 6, 0, 3), (0, 0, 11, 9, 22), 8, 2, 32, 4), "gqa4-mixed"),
    _cpu(Case((19, 2), (3, 30), 6, 2, 32, 4, block_m=32), "gqa3-chunk-and-spec"),
    _cpu(Case((1, 7), (0, 5), 2, 2, 64, 8), "gqa1-context1"),
    _gpu(Case((512, 100, 1, 37, 4), (0, 1000, 2047, 300, 4000), 32, 8, 128, 16, BF16,
              block_m=64, block_n=64), "llama8b-bf16"),
    _gpu(Case((300, 5), (200, 700), 32, 8, 128, 16, F32, block_m=64, block_n=32),
         "llama8b-f32"),
    _gpu(Case((257, 3, 64), (0, 900, 64), 9, 3, 64, 16, BF16, block_m=64, block_n=64),
         "smollm-gqa3-bf16"),
]


@pytest.mark.parametrize("device,case", CASES)
def test_matches_reference(device: str, case: Case, make_paged, check_rel) -> None:
    seq_lens_l = [p + n for p, n in zip(case.prefixes, case.q_lens, strict=True)]
    k_cache, v_cache, tables = make_paged(seq_lens_l, case.block_size, case.kv_heads,
                                          case.head_dim, case.dtype, device)
    qsl_l = [0]
    for n in case.q_lens:
        qsl_l.append(qsl_l[-1] + n)
    t = qsl_l[-1]
    pad = 3  # rows past query_start_loc[B] must be left alone
    q = torch.randn(t + pad, case.heads, case.head_dim, device=device).to(case.dtype)
    qsl = torch.tensor(qsl_l, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(seq_lens_l, dtype=torch.int32, device=device)
    scale = case.head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    got = paged_attention_extend(q, k_cache, v_cache, tables, qsl, seq_lens, scale, out=out,
                                 config=ExtendConfig(block_m=case.block_m, block_n=case.block_n))
    assert got is out
    ref = torch_ops.paged_attention_extend(q[:t].float(), k_cache.float(), v_cache.float(),
                                           tables, qsl, seq_lens, scale)
    check_rel(out[:t].float(), ref, 1e-5 if case.dtype == F32 else 1e-2)
    assert out[t:].isnan().all()


def test_rejects_bad_arguments() -> None:
    q = torch.randn(4, 4, 32)
    k = torch.randn(5, 4, 2, 32)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.full((2,), 2, dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start_loc: expected shape"):
        paged_attention_extend(q, k, k, tables, qsl[:2], lens, 1.0)
    with pytest.raises(ValueError, match="v_cache: expected shape"):
        paged_attention_extend(q, k, k[:4], tables, qsl, lens, 1.0)
    with pytest.raises(ValueError, match="out: dtype"):
        paged_attention_extend(q, k, k, tables, qsl, lens, 1.0, out=q.double())
