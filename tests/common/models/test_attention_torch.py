"""The torch backend attends a step in a few padded batches of sequences; the result must equal
the reference oracle, which attends each sequence on its own."""

from __future__ import annotations

import pytest
import torch

from common.models.attention import AttentionMetadata
from common.models.attention_torch import MAX_PADDING, TorchAttentionBackend, _groups
from kernels import torch_ops

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
        alone = torch_ops.paged_attention_extend(
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
        torch_ops.paged_attention_extend(q, k_cache, v_cache, decode.block_tables,
                                         decode.query_start_loc, decode.seq_lens, 0.25),
        atol=1e-5, rtol=1e-5)
    # One-token chunks that are not flagged as decodes take the extend path: same answer.
    extend = _meta([1, 1, 1], [3, 9, 17], num_decodes=0)
    torch.testing.assert_close(backend.forward(q, k_cache, v_cache, extend, 0.25),
                               backend.forward(q, k_cache, v_cache, decode, 0.25),
                               atol=1e-5, rtol=1e-5)


def _step(q_lens: list[int], ctx_lens: list[int], num_decodes: int, heads: int, kv_heads: int,
          block_size: int, seed: int):
    """A step's metadata, q, and K/V pools that hold random values at every position of every
    context and NaN everywhere else (what an unwritten slot may hold)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_each) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_each)
    k_cache = torch.full((num_blocks, block_size, kv_heads, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, used = [], 0
    for c, n in zip(ctx_lens, blocks_each, strict=True):
        table = perm[used:used + n]
        used += n
        for p in range(c):
            blk, off = table[p // block_size], p % block_size
            k_cache[blk, off] = torch.randn(kv_heads, D, generator=gen)
            v_cache[blk, off] = torch.randn(kv_heads, D, generator=gen)
        tables.append(table + [0] * (width - n))
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32), num_decodes=num_decodes,
        num_decode_tokens=num_decodes, max_query_len=max(q_lens), max_seq_len=max(ctx_lens))
    q = torch.randn(sum(q_lens), heads, D, generator=gen)
    return meta, q, k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 4, 4), (4, 2, 16), (9, 3, 16),
                                                       (8, 2, 8)])
@pytest.mark.parametrize("q_lens,ctx_lens,num_decodes", [
    ([1, 1, 1, 1], [1, 17, 40, 5], 4),                       # decodes only, ragged contexts
    ([12, 12, 12, 12], [12, 12, 12, 12], 0),                 # equal prefills: one group
    ([1, 1, 30, 2, 0, 7, 64], [9, 33, 30, 50, 21, 7, 64], 2),  # mixed, one chunk with no tokens
    ([100, 3, 3, 5, 2, 1], [100, 3, 90, 200, 5, 1], 0),      # lengths far apart: several groups
])
def test_batched_step_equals_reference_oracle(heads, kv_heads, block_size, q_lens, ctx_lens,
                                              num_decodes):
    meta, q, k_cache, v_cache = _step(q_lens, ctx_lens, num_decodes, heads, kv_heads,
                                      block_size, seed=len(q_lens) + heads + block_size)
    backend = TorchAttentionBackend()
    out = backend.forward(q, k_cache, v_cache, meta, scale=0.3)
    want = torch_ops.paged_attention_extend(q, k_cache, v_cache, meta.block_tables,
                                            meta.query_start_loc, meta.seq_lens, 0.3)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The second layer of the step reuses the plan; a new step (metadata object) gets its own.
    torch.testing.assert_close(backend.forward(q * 2, k_cache, v_cache, meta, 0.3),
                               torch_ops.paged_attention_extend(
                                   q * 2, k_cache, v_cache, meta.block_tables,
                                   meta.query_start_loc, meta.seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)
    fewer = _step(q_lens[:1], ctx_lens[:1], min(num_decodes, 1), heads, kv_heads, block_size, 7)
    torch.testing.assert_close(backend.forward(fewer[1], fewer[2], fewer[3], fewer[0], 0.3),
                               torch_ops.paged_attention_extend(
                                   fewer[1], fewer[2], fewer[3], fewer[0].block_tables,
                                   fewer[0].query_start_loc, fewer[0].seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)


def test_groups_partition_the_sequences_and_bound_the_padding():
    gen = torch.Generator().manual_seed(3)
    q_lens = torch.randint(0, 300, (200,), generator=gen).tolist()
    ctx_lens = [q + p for q, p in zip(q_lens, torch.randint(0, 900, (200,), generator=gen).tolist(),
                                      strict=True)]
    groups = _groups(q_lens, ctx_lens)
    assert sorted(b for g in groups for b in g) == [b for b in range(200) if q_lens[b]]
    assert len(groups) < 100
    for g in groups:
        work = sum(q_lens[b] * ctx_lens[b] for b in g)
        assert len(g) * max(q_lens[b] for b in g) * max(ctx_lens[b] for b in g) <= (
            MAX_PADDING * work)
    assert _groups([128] * 16, [128] * 16) == [list(range(16))]
