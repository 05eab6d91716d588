"""Paged decode attention: one query token per sequence, split-K over the context (flash-decoding).

Stage 1 runs one program per (sequence, kv head, split). It loads the query rows of all the query
heads that share the kv head (GQA), so each K/V tile is read from the pool once, and runs an
online softmax over its share of the context. With one split it writes the normalised output;
otherwise it leaves (max, sum, unnormalised acc) per split in a workspace and stage 2 merges the
splits of each (sequence, head). The grid depends only on shapes and `num_splits`, never on the
values of `seq_lens`, so a decode step that calls this can be captured in a CUDA graph.

Context split of one sequence (tiles of BLOCK_N tokens, splits of whole tiles):

    seq_len = 11 tokens, BLOCK_N = 4, num_splits = 3  ->  tiles_per_split = cdiv(3, 3) = 1
    | split 0: 0..3 | split 1: 4..7 | split 2: 8..10 |
    seq_len = 3: split 0 holds 0..2 and splits 1, 2 are empty (max -inf, sum 0: weight 0).

Rows whose seq_len is 0 (batch padding) come out as zeros.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor, next_pow2

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters of stage 1 (tuned on the H200, see bench/NOTES.md)."""
    block_n: int = 64      # tokens per K/V tile
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 4         # default_num_splits aims at about this many programs per multiprocessor


@dataclass(frozen=True, slots=True)
class DecodeWorkspace:
    """Scratch of the split-K path, allocated once (e.g. before CUDA-graph capture)."""
    acc: torch.Tensor  # [max_batch, heads, num_splits, head_dim] float32, unnormalised output
    max: torch.Tensor  # [max_batch, heads, num_splits] float32, running max (log2 units)
    sum: torch.Tensor  # [max_batch, heads, num_splits] float32, running sum of exp2

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, num_splits: int,
                 device: torch.device | str) -> DecodeWorkspace:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(max_batch, num_heads, num_splits, head_dim, **f32),
                   torch.empty(max_batch, num_heads, num_splits, **f32),
                   torch.empty(max_batch, num_heads, num_splits, **f32))

    @property
    def num_splits(self) -> int:
        return self.acc.shape[2]


@triton.jit
def _decode_split_kernel(
    q_ptr,                 # [B, H, D]
    k_ptr, v_ptr,          # [num_blocks, BLOCK_SIZE, KVH, D]
    tables_ptr,            # [B, max_blocks] int32
    seq_lens_ptr,          # [B] int32
    out_ptr,               # [B, H, D], written when SINGLE_SPLIT
    acc_ptr,               # [>=B, H, num_splits, D] float32, written unless SINGLE_SPLIT
    max_ptr, sum_ptr,      # [>=B, H, num_splits] float32
    qk_scale,              # softmax scale * log2(e)
    num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (block * stride_kb + row * stride_kt + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + (block * stride_vb + row * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        part = (b * NUM_HEADS + heads) * num_splits + split  # [BLOCK_G]
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(max_ptr + part, m_i, mask=g_mask)
        tl.store(sum_ptr + part, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    acc_ptr,               # [>=B, H, num_splits, D] float32
    max_ptr, sum_ptr,      # [>=B, H, num_splits] float32
    out_ptr,               # [B, H, D]
    num_splits,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    part = (b * NUM_HEADS + h) * num_splits + offs_s
    m = tl.load(max_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + part, mask=s_mask, other=0.0)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty
    w = tl.exp2(m - m_all)  # 0 for empty splits
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_s * w, 0)
    o = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@functools.cache
def _processor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: few programs, still more than one split on small tests


def default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device,
                       config: DecodeConfig) -> int:
    """Splits so that batch * kv_heads * splits programs fill the GPU up to `config.waves` times
    over, with at least two tiles per split, rounded down to a power of two (on the H200, 3
    splits of 32 x 8 programs ran 15% slower than 2). Uses shapes only (no device sync), so
    `max_context` is the table capacity, an upper bound on seq_lens."""
    want = cdiv(config.waves * _processor_count(device), batch * kv_heads)
    most = max(1, max_context // (2 * config.block_n))
    return 1 << (min(want, most, 128).bit_length() - 1)


def paged_attention_decode(
    q: torch.Tensor,             # [B, heads, head_dim]
    k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,      # [B] int32, context incl. the new token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, heads, head_dim], q's dtype
    num_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:               # [B, heads, head_dim]
    """Same result as reference.paged_attention_decode. For CUDA graphs pass `out`, a
    `workspace` allocated beforehand and a fixed `num_splits` (the workspace's by default)."""
    config = config or DecodeConfig()
    dev = q.device
    check_tensor("q", q, dim=3, dtypes=FLOAT_DTYPES)
    b, h, d = q.shape
    check_tensor("k_cache", k_cache, dim=4, dtypes=FLOAT_DTYPES, device=dev)
    _, block_size, kvh, _ = k_cache.shape
    check_tensor("k_cache", k_cache, shape=(None, None, None, d))
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                 device=dev)
    check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("block_tables", block_tables, shape=(b, None))
    check_tensor("seq_lens", seq_lens, shape=(b,), dtypes=(torch.int32,), device=dev)
    if h % kvh:
        raise ValueError(f"q has {h} heads, not a multiple of the cache's {kvh} kv heads")
    if d < 16:
        raise ValueError(f"head_dim {d} < 16 is not supported by tl.dot")
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=(b, h, d), dtypes=(q.dtype,), device=dev)
    if num_splits is None:
        num_splits = (workspace.num_splits if workspace is not None else default_num_splits(
            b, kvh, block_tables.shape[1] * block_size, dev, config))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if b == 0:
        return out
    if num_splits > 1:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(b, h, d, num_splits, dev)
        ws = workspace.acc
        if ws.shape[0] < b or ws.shape[1:] != (h, num_splits, d) or ws.device != dev:
            raise ValueError(f"workspace {tuple(ws.shape)} on {ws.device} does not fit batch {b}, "
                             f"{h} heads, {num_splits} splits, head_dim {d} on {dev}")
        acc, m, l_sum = workspace.acc, workspace.max, workspace.sum
    else:
        acc = m = l_sum = out  # unused by the single-split kernel

    group = h // kvh
    block_d = next_pow2(d)
    _decode_split_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, acc, m, l_sum,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=h, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, SINGLE_SPLIT=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(b, h)](
            acc, m, l_sum, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=h, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=next_pow2(num_splits),
            num_warps=4 if d >= 128 else 2,
        )
    return out

