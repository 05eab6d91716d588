"""The "torch" attention backend, the CPU serving path: batched attention over the paged pool,
with the semantics of kernels.torch_ops (the tests compare the two).

Where kernels.cpu_decode_attention serves (a CPU, float32 or bfloat16 pools, built here), the
step's leading single-token sequences (its decodes) go to its decode kernel and the rest
(prefill and extend chunks) to its extend kernel, both reading the contexts in place from the
pool. Elsewhere the step is attended in plain torch as follows. (The extend kernel against this
path on the first prefill step of bench/cpu_throughput.py's ShareGPT-like workload, 15 prompts
of 22-376 tokens in 2048, one layer, 1 thread, AVX-512 box: 11.8 against 27.9 ms in float32,
12.0 against 28.8 in bf16; 2 threads on a busy box: 16.0 against 43.2 and 205.)

A step is attended in a few large calls instead of one per sequence: its sequences are grouped
(see `_groups`) into padded batches, each one masked scaled_dot_product_attention of
[n, heads, max_q, d] queries against [n, kv_heads, max_blocks * block_size, d] keys and values
that are gathered from the pool a block at a time (one index_select each). A batch of decodes
(max_q == 1) puts the query heads that share a KV head in the rows of one query block instead,
[n, kv_heads, group, d], so every gathered key is read once for all of them.

Gathered positions past a sequence's end (the rest of its last block, padding blocks) are zeroed
in the copy: the additive mask gives them zero weight, but the pool's unwritten slots may hold
NaN, and a zero weight times NaN is still NaN. A padded query row repeats its sequence's last
query (its output is dropped).

The gather indices and masks depend only on the metadata, so they are built once per step (by
the first layer) and reused by the others: the backend keeps the plan of the last metadata object
it saw, and assumes that object is not modified once built (the model runner builds one a step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from common.models.attention import AttentionBackend, AttentionMetadata
from kernels import cpu_decode_attention, torch_ops

# A batch may do at most this many times the attention work (query x key pairs) of its sequences
# attended one by one: one call for several sequences is cheaper than a call each.
MAX_PADDING = 2.0


class _Batch(NamedTuple):
    """Sequences of the step attended in one padded call; P = max_blocks * block_size."""
    blocks: torch.Tensor     # [n * max_blocks]: pool blocks to gather, sequence by sequence
    past_end: torch.Tensor   # rows of the gathered [n * P] positions past their sequence's end
    bias: torch.Tensor       # [n, 1, q, P] additive mask: 0 (attend) or -inf
    q_rows: torch.Tensor     # [n * q]: the step token of each padded query
    out_rows: torch.Tensor   # [m]: the step tokens the batch computes ...
    src_rows: torch.Tensor | None  # [m]: ... and where each sits among the n * q padded
                                   # outputs; None: all of them, in order (no padded query)


def _groups(q_lens: list[int], ctx_lens: list[int]) -> list[list[int]]:
    """The sequences with new tokens, in groups to attend together, longest contexts first.

    A group's padded work is n * max_q * max_ctx; a sequence joins the current group while
    that stays within MAX_PADDING x the group's own work, sum(q_len * ctx)."""
    order = sorted((b for b in range(len(q_lens)) if q_lens[b]), key=lambda b: -ctx_lens[b])
    groups: list[list[int]] = []
    max_q = work = 0
    for b in order:
        if groups:
            group = groups[-1]
            q = max(max_q, q_lens[b])
            padded = (len(group) + 1) * q * ctx_lens[group[0]]
            if padded <= MAX_PADDING * (work + q_lens[b] * ctx_lens[b]):
                group.append(b)
                max_q, work = q, work + q_lens[b] * ctx_lens[b]
                continue
        groups.append([b])
        max_q, work = q_lens[b], q_lens[b] * ctx_lens[b]
    return groups


def _batch(meta: AttentionMetadata, seqs: list[int], starts: list[int], q_lens: list[int],
           ctx_lens: list[int], block_size: int, dtype: torch.dtype) -> _Batch:
    """Sequence b's queries are step tokens starts[b] .. starts[b] + q_lens[b] - 1, the last
    q_lens[b] of its ctx_lens[b] positions: query i sees positions <= ctx - q_len + i."""
    dev = meta.seq_lens.device
    n_blocks = -(-max(ctx_lens[b] for b in seqs) // block_size)
    width_kv = n_blocks * block_size
    width_q = max(q_lens[b] for b in seqs)
    idx = torch.tensor(seqs, device=dev)
    start = torch.tensor([starts[b] for b in seqs], device=dev)[:, None]
    q_len = torch.tensor([q_lens[b] for b in seqs], device=dev)[:, None]
    ctx = torch.tensor([ctx_lens[b] for b in seqs], device=dev)[:, None]
    blocks = meta.block_tables.index_select(0, idx)[:, :n_blocks].long().reshape(-1)
    pos = torch.arange(width_kv, device=dev)[None, :]
    past_end = torch.nonzero((pos >= ctx).view(-1)).view(-1)
    i = torch.arange(width_q, device=dev)[None, :]
    real = (i < q_len).view(-1)                      # padded query rows are not real ...
    i = torch.minimum(i, q_len - 1)                  # ... and repeat the last real one
    last_seen = ctx - q_len + i                      # [n, width_q]
    bias = torch.zeros(len(seqs), 1, width_q, width_kv, dtype=dtype, device=dev)
    bias.masked_fill_((pos[:, None, :] > last_seen[:, :, None])[:, None], float("-inf"))
    q_rows = (start + i).view(-1)
    if all(q_lens[b] == width_q for b in seqs):
        return _Batch(blocks, past_end, bias, q_rows, q_rows, None)
    src = torch.nonzero(real).view(-1)
    return _Batch(blocks, past_end, bias, q_rows, q_rows[src], src)


class _Plan(NamedTuple):
    decodes: int           # leading sequences of one token each, for the decode kernel
    batches: list[_Batch]  # the rest, in padded batches (none: all through the kernels)


def _plan(meta: AttentionMetadata, block_size: int, dtype: torch.dtype, kernel: bool) -> _Plan:
    ctx = meta.seq_lens.tolist()
    qsl = meta.query_start_loc.tolist()
    starts = qsl[:-1]
    q_lens = [e - s for s, e in zip(starts, qsl[1:], strict=True)]
    decodes = 0
    while kernel and decodes < len(q_lens) and q_lens[decodes] == 1:
        decodes += 1
    if kernel:  # the rest through the extend kernel
        return _Plan(decodes, [])
    rest = [0] * decodes + q_lens[decodes:]  # _groups leaves out sequences with no token
    return _Plan(decodes, [_batch(meta, group, starts, q_lens, ctx, block_size, dtype)
                           for group in _groups(rest, ctx)])


def _gather(cache: torch.Tensor, batch: _Batch, dtype: torch.dtype) -> torch.Tensor:
    """The batch's contexts from cache [num_blocks, block_size, kv_heads, d]:
    [n, kv_heads, P, d] (a transposed view of a fresh copy), zero past each sequence's end."""
    _, _, kvh, d = cache.shape
    n = batch.bias.shape[0]
    # An fp8 pool is read in the compute dtype (its scale is 1.0: the cast dequantizes).
    x = cache.index_select(0, batch.blocks).to(dtype).view(-1, kvh, d)
    x.index_fill_(0, batch.past_end, 0)
    return x.view(n, -1, kvh, d).transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # The last plan and what it was built for: (metadata, (block_size, dtype, kernel), plan).
        self._planned: tuple[AttentionMetadata, tuple[int, torch.dtype, bool], _Plan] | None = None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        torch_ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def _step_plan(self, meta: AttentionMetadata, block_size: int, dtype: torch.dtype,
                   kernel: bool) -> _Plan:
        key = (block_size, dtype, kernel)
        if self._planned is None or self._planned[0] is not meta or self._planned[1] != key:
            self._planned = (meta, key, _plan(meta, block_size, dtype, kernel))
        return self._planned[2]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, h, d = q.shape
        kvh = k_cache.shape[2]
        out = torch.empty_like(q)
        kernel = cpu_decode_attention.serves(q, k_cache)
        plan = self._step_plan(meta, k_cache.shape[1], q.dtype, kernel)
        if plan.decodes:
            m = plan.decodes
            cpu_decode_attention.paged_decode_attention(
                q[:m], k_cache, v_cache, meta.block_tables[:m], meta.seq_lens[:m], scale, out[:m])
        if kernel and plan.decodes < meta.seq_lens.shape[0]:
            cpu_decode_attention.paged_extend_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                plan.decodes, scale, out)
        for b in plan.batches:
            n, width_q = b.bias.shape[0], b.bias.shape[2]
            qb = q.index_select(0, b.q_rows)
            k, v = _gather(k_cache, b, q.dtype), _gather(v_cache, b, q.dtype)
            if width_q == 1:  # decodes: [n, kv_heads, group, d], the group's heads as rows
                o = F.scaled_dot_product_attention(qb.view(n, kvh, h // kvh, d), k, v,
                                                   attn_mask=b.bias, scale=scale)
            else:
                o = F.scaled_dot_product_attention(
                    qb.view(n, width_q, h, d).transpose(1, 2), k, v, attn_mask=b.bias,
                    scale=scale, enable_gqa=(h != kvh)).transpose(1, 2)
            o = o.reshape(n * width_q, h, d)
            if b.src_rows is not None:
                o = o.index_select(0, b.src_rows)
            out.index_copy_(0, b.out_rows, o)
        return out
