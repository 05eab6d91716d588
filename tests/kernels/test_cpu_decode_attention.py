"""kernels.cpu_decode_attention against its reference, kernels.torch_ops.paged_attention_decode,
and the torch attention backend's decode rows through it."""

from __future__ import annotations

import pytest
import torch

from common.models.attention import AttentionMetadata
from common.models.attention_torch import TorchAttentionBackend
from kernels import cpu_decode_attention
from kernels.torch_ops import paged_attention_decode, paged_attention_extend

pytestmark = pytest.mark.skipif(not cpu_decode_attention.available(),
                                reason="the CPU decode attention kernel does not build here")


def _pool(num_blocks: int, bs: int, kvh: int, d: int, dtype: torch.dtype,
          g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    return k, v


@pytest.mark.parametrize("d", cpu_decode_attention.HEAD_DIMS)
@pytest.mark.parametrize("heads,kvh", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(d: int, heads: int, kvh: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(d + heads)
    bs, num_blocks = 16, 40
    k, v = _pool(num_blocks, bs, kvh, d, dtype, g)
    k[0].fill_(float("nan"))  # never read: no table below holds block 0 within its length
    lens = torch.tensor([1, 15, 16, 17, 100, 163], dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(lens), 11, dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        nb = -(-n // bs)
        tables[b, :nb] = perm[b * 6:b * 6 + nb] if b < 5 else perm[:nb]
    # q as a row slice of a wider tensor, as the qkv projection's output is
    q = torch.randn(len(lens), heads * d + 5, generator=g).to(dtype)[:, :heads * d]
    q = q.view(len(lens), heads, d)
    out = torch.empty(len(lens), heads, d, dtype=dtype)
    cpu_decode_attention.paged_decode_attention(q, k, v, tables, lens, d ** -0.5, out)
    ref = paged_attention_decode(q.float(), k.float(), v.float(), tables, lens, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_backend_mixed_step() -> None:
    """A step of three decodes then two prefill chunks: the decodes go to the decode kernel, the
    chunks to the extend kernel; every row matches the reference."""
    g = torch.Generator().manual_seed(1)
    bs, kvh, heads, d = 16, 3, 9, 64
    k, v = _pool(64, bs, kvh, d, torch.float32, g)
    q_lens, lens = [1, 1, 1, 20, 7], [40, 5, 77, 20, 50]
    tables = torch.zeros(5, 5, dtype=torch.int32)
    used = iter((torch.randperm(63, generator=g) + 1).tolist())
    for b, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[b, j] = next(used)
    qsl = torch.tensor([0, 1, 2, 3, 23, 30], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(30, dtype=torch.long), query_start_loc=qsl,
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_decodes=3,
        num_decode_tokens=3, max_query_len=20, max_seq_len=77)
    q = torch.randn(30, heads, d, generator=g)
    out = TorchAttentionBackend().forward(q, k, v, meta, d ** -0.5)
    ref = paged_attention_extend(q, k, v, tables, qsl, meta.seq_lens, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert sum(q_lens) == q.shape[0]


@pytest.mark.parametrize("d,heads,kvh", [(64, 9, 3), (128, 4, 4), (32, 8, 1), (256, 2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_reference(d: int, heads: int, kvh: int, dtype: torch.dtype) -> None:
    """The extend kernel on chunks with and without a cached prefix (tiles of 16 tokens cut
    across blocks, contexts ending mid-block beside NaN slots), from the third sequence on: the
    rows of the first two are not written."""
    g = torch.Generator().manual_seed(d + heads)
    bs, num_blocks = 16, 200
    k, v = _pool(num_blocks, bs, kvh, d, dtype, g)
    k[0].fill_(float("nan"))  # never read: block 0 is in no table
    v[0].fill_(float("nan"))
    q_lens, lens = [1, 1, 20, 7, 1, 33, 16, 17], [40, 5, 20, 50, 3, 100, 16, 300]
    tables = torch.zeros(len(lens), 20, dtype=torch.int32)
    used = iter((torch.randperm(num_blocks - 1, generator=g) + 1).tolist())
    for b, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[b, j] = next(used)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    t = sum(q_lens)
    q = torch.randn(t, heads * d + 8, generator=g).to(dtype)[:, :heads * d].view(t, heads, d)
    out = torch.zeros(t, heads, d, dtype=dtype)
    cpu_decode_attention.paged_extend_attention(q, k, v, tables, qsl, seq_lens, 2, d ** -0.5, out)
    ref = paged_attention_extend(q.float(), k.float(), v.float(), tables, qsl, seq_lens, d ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[2:].float(), ref[2:], atol=tol, rtol=tol)
    assert not out[:2].any()
