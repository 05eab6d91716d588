"""The torch backend splits a step into one batched decode call and the extend call; the result
must equal attending each sequence on its own."""

from __future__ import annotations

import torch

from common.models.attention import AttentionMetadata
from common.models.attention_torch import TorchAttentionBackend
from kernels import reference

HEADS, KV_HEADS, D, BS, NB = 4, 2, 16, 4, 32


def _meta(q_lens: list[int], seq_lens: list[int], num_decodes: int) -> AttentionMetadata:
    perm = torch.randperm(NB, generator=torch.Generator().manual_seed(1))
    width = max(-(-s // BS) for s in seq_lens)
    tables, slots, used = [], [], 0
    for q_len, s in zip(q_lens, seq_lens, strict=True):
        n = -(-s // BS)
        table = perm[used:used + n].tolist()
        used += n
        slots += [table[p // BS] * BS + p % BS for p in range(s - q_len, s)]
        tables.append(table + [0] * (width - n))
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, max_query_len=max(q_lens), max_seq_len=max(seq_lens))


def test_mixed_step_equals_each_sequence_alone():
    gen = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [1, 1, 5, 9], [7, 13, 5, 20]  # two decodes, a prefill, an extend
    meta = _meta(q_lens, seq_lens, num_decodes=2)
    k_cache = torch.randn(NB, BS, KV_HEADS, D, generator=gen)
    v_cache = torch.randn(NB, BS, KV_HEADS, D, generator=gen)
    q = torch.randn(sum(q_lens), HEADS, D, generator=gen)
    backend = TorchAttentionBackend()
    k_new = torch.randn(sum(q_lens), KV_HEADS, D, generator=gen)
    backend.store_kv(k_new, k_new * 2, k_cache, v_cache, meta)
    assert torch.equal(k_cache.view(-1, KV_HEADS, D)[meta.slot_mapping], k_new)
    out = backend.forward(q, k_cache, v_cache, meta, scale=0.25)
    for b in range(len(q_lens)):
        s, e = int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1])
        alone = reference.paged_attention_extend(
            q[s:e], k_cache, v_cache, meta.block_tables[b:b + 1],
            torch.tensor([0, e - s], dtype=torch.int32), meta.seq_lens[b:b + 1], 0.25)
        torch.testing.assert_close(out[s:e], alone, atol=1e-5, rtol=1e-5)


def test_decode_only_and_extend_only_steps():
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.randn(NB, BS, KV_HEADS, D, generator=gen)
    v_cache = torch.randn(NB, BS, KV_HEADS, D, generator=gen)
    backend = TorchAttentionBackend()
    decode = _meta([1, 1, 1], [3, 9, 17], num_decodes=3)
    q = torch.randn(3, HEADS, D, generator=gen)
    torch.testing.assert_close(
        backend.forward(q, k_cache, v_cache, decode, 0.25),
        reference.paged_attention_extend(q, k_cache, v_cache, decode.block_tables,
                                         decode.query_start_loc, decode.seq_lens, 0.25),
        atol=1e-5, rtol=1e-5)
    # One-token chunks that are not flagged as decodes take the extend path: same answer.
    extend = _meta([1, 1, 1], [3, 9, 17], num_decodes=0)
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache, extend, 0.25),
                               backend.forward(q, k_cache, v_cache, decode, 0.25),
                               atol=1e-5, rtol=1e-5)
