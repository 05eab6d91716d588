"""common.models.attention_triton: a mixed decode + extend step against the reference ops.

It lives beside the kernel tests because it runs them (through the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from common.models.attention import AttentionMetadata
from common.models.attention_triton import TritonAttentionBackend
from kernels import torch_ops

STEPS = [
    # device, (q_lens, prefixes): the first 3 sequences decode one token each
    pytest.param("cpu", (1, 1, 1, 6, 3), (0, 9, 16, 0, 21), 4, 2, 32, 4, torch.float32, 1e-5,
                 id="cpu"),
    pytest.param("cuda", (1, 1, 1, 200, 40), (0, 900, 3000, 0, 513), 32, 8, 128, 16,
                 torch.bfloat16, 1e-2, id="cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,q_lens,prefixes,heads,kv_heads,head_dim,block_size,dtype,tol",
                         STEPS)
@pytest.mark.parametrize("decode_splits", [None, 2])
def test_mixed_step(device, q_lens, prefixes, heads, kv_heads, head_dim, block_size, dtype, tol,
                    decode_splits, make_paged, check_rel) -> None:
    seq_lens_l = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    k_cache, v_cache, tables = make_paged(seq_lens_l, block_size, kv_heads, head_dim, dtype,
                                          device)
    slots = []
    for b, (p, n) in enumerate(zip(prefixes, q_lens, strict=True)):
        for pos in range(p, p + n):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    t = sum(q_lens)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    as_i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, **as_i32),
        seq_lens=torch.tensor(seq_lens_l, **as_i32),
        block_tables=tables, num_decodes=3, num_decode_tokens=3,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens_l))
    q = torch.randn(t, heads, head_dim, device=device).to(dtype)
    k = torch.randn(t, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(t, kv_heads, head_dim, device=device).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    backend = TritonAttentionBackend(decode_splits=decode_splits)
    assert backend.name == "triton"
    backend.store_kv(k, v, k_cache, v_cache, meta)
    out = backend.forward(q, k_cache, v_cache, meta, head_dim ** -0.5)

    torch_ops.store_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    want = torch_ops.paged_attention_extend(q.float(), k_ref.float(), v_ref.float(), tables,
                                            meta.query_start_loc, meta.seq_lens,
                                            head_dim ** -0.5)
    check_rel(out.float(), want, tol)
