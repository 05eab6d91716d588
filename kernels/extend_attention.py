"""Paged extend attention: a variable-length batch of new tokens attending causally to themselves
and to their cached prefix (chunked prefill, prefix-cache hits, speculative verification).

One program per (query tile, kv head). A tile holds BLOCK_Q new tokens of one sequence times the
GROUP query heads that share the kv head, as BLOCK_M = next_pow2(BLOCK_Q * GROUP) rows, so each
K/V tile is read once for the whole group. Flash-attention online softmax over K/V tiles.

Tiles are numbered without a device sync: sequence b owns program ids starting at
qsl[b] // BLOCK_Q + b (strictly increasing in b), and at least cdiv(q_len_b, BLOCK_Q) of them; a
program finds its sequence by binary search over query_start_loc, and programs past the end of a
sequence's tokens do nothing. Grid: cdiv(T, BLOCK_Q) + B programs per kv head.

Key ranges of one tile whose first new token sits at position p0 (prefix = seq_len - q_len):

    keys [0, full_end)          full_end = p0 rounded down to BLOCK_N: below every row, no mask
    keys [full_end, last + 1)   causal mask key <= row position
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor, next_pow2
from kernels.kv_store import KV_DTYPES

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class ExtendConfig:
    block_m: int = 64      # rows per program: new tokens x query heads of one kv head
    block_n: int = 64      # keys per K/V tile
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _attend(acc, m_i, l_i,             # [BLOCK_M, BLOCK_D], [BLOCK_M], [BLOCK_M] float32
            q, q_pos,                  # [BLOCK_M, BLOCK_D], [BLOCK_M] row positions
            k_ptr, v_ptr, table, kvh, lo, hi, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (block * stride_kb + row * stride_kt + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + (block * stride_vb + row * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    q_ptr,                 # [T, H, D]
    k_ptr, v_ptr,          # [num_blocks, BLOCK_SIZE, KVH, D]
    out_ptr,               # [T, H, D]
    tables_ptr,            # [B, max_blocks] int32
    qsl_ptr,               # [B + 1] int32
    seq_lens_ptr,          # [B] int32
    qk_scale,              # softmax scale * log2(e)
    num_seqs, search_steps,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    lo = pid * 0  # invariant: qsl[lo] // BLOCK_Q + lo <= pid < (same at hi)
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first new token of this tile
    n_tok = tl.maximum(tl.minimum(q_len - first, BLOCK_Q), 0)
    prefix = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    mask = (tok < n_tok)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_pos = prefix + first + tok
    rows = (q_start + first + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if F16_DOT:  # an fp8 pool: its tiles widen to fp16 directly (to bf16 through float32)
        q = q.to(tl.float16)

    kv_end = tl.where(n_tok > 0, prefix + first + n_tok, 0)
    full_end = tl.where(n_tok > 0, (prefix + first) // BLOCK_N * BLOCK_N, 0)
    table = tables_ptr + seq.to(tl.int64) * stride_tb
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, kvh, 0, full_end,
                            qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                            stride_vh, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, False,
                            DOT_PRECISION)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, k_ptr, v_ptr, table, kvh, full_end, kv_end,
                            qk_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                            stride_vh, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, True,
                            DOT_PRECISION)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


def paged_attention_extend(
    q: torch.Tensor,                # [T, heads, head_dim]
    k_cache: torch.Tensor,          # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,          # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,     # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, offsets into T
    seq_lens: torch.Tensor,         # [B] int32, context incl. new tokens
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, heads, head_dim], q's dtype
    config: ExtendConfig | None = None,
) -> torch.Tensor:                  # [T, heads, head_dim]
    """Same result as torch_ops.paged_attention_extend, without a device sync. Rows of q past
    query_start_loc[B] (padding) are left unwritten."""
    config = config or ExtendConfig()
    dev = q.device
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES)
    t, h, d = q.shape
    check_tensor("k_cache", k_cache, dim=4, dtypes=KV_DTYPES, device=dev)
    _, block_size, kvh, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, d))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=dev)
    check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=dev)
    b = block_tables.shape[0]
    check_tensor("query_start_loc", query_start_loc, shape=(b + 1,), dtypes=(torch.int32,),
                 device=dev)
    check_tensor("seq_lens", seq_lens, shape=(b,), dtypes=(torch.int32,), device=dev)
    if h % kvh:
        raise ValueError(f"q has {h} heads, not a multiple of the cache's {kvh} kv heads")
    if d < 16:
        raise ValueError(f"head_dim {d} < 16 is not supported by tl.dot")
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=(t, h, d), dtypes=(q.dtype,), device=dev)
    if b == 0 or t == 0:
        return out

    group = h // kvh
    block_m = max(config.block_m, next_pow2(group))
    block_q = block_m // group
    _extend_kernel[(cdiv(t, block_q) + b, kvh)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, b, b.bit_length(),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOT=k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
