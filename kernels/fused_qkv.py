"""Batch-1 attention input in one launch: residual add + RMSNorm, the qkv GEMV, rotary on q and k,
and the new token's K/V into the paged cache.

The same work as kernels.fused_gemv.norm_linear followed by kernels.kv_store.rotary_store_kv,
which at batch 1 is one launch fewer per layer. Rotary (neox, rotate-half) pairs output row i of a
head with row i + head_dim / 2, so a program does not own BLOCK_N consecutive weight rows but
PAIRS = BLOCK_N / 2 pairs of rows, all in one head:

    pair j (of N / 2):  head = j // HALF, i = j % HALF
                        rows head * head_dim + i and head * head_dim + HALF + i

Each row is still read whole along K, so the weight streams as in the plain GEMV. The heads are
laid out as the fused qkv weight is: num_heads q heads, then num_kv_heads k heads, then v heads.
A program's output pair is rounded to the input dtype (the unfused qkv output), rotated in
float32 and rounded again (q and k heads, as rotary_store_kv does), then stored: q heads to the
returned q, k and v heads into the cache at the token's slot (skipped when the slot is negative,
a padding row). The norm and its rounding are those of fused_gemv.norm_linear.

FP8: an e4m3fn weight with its row scales (weight_scale) is read as fused_gemv reads it, and an
e4m3fn cache (--kv-cache-dtype fp8, scale 1.0) takes the rounded K/V saturated to +-448, as
kernels.kv_store writes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import skinny_gemm
from kernels.checks import FLOAT_DTYPES, check_tensor
from kernels.fused_gemv import input_tile
from kernels.kv_store import KV_DTYPES, cache_value
from kernels.skinny_gemm import (
    SkinnyConfig,
    check_gemv_reduction,
    default_config,
    gemv_acc,
    gemv_acc_init,
    gemv_sum,
    processor_count,
)


@triton.jit
def _norm_qkv_rotary_kernel(
    h_ptr, res_ptr, g_ptr,     # [K] hidden, residual (when HAS_RESIDUAL), norm weight
    w_ptr,                     # [N, K] qkv weight, N = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    bias_ptr,                  # [N], read when HAS_BIAS
    scale_ptr,                 # [N] float32, read when HAS_SCALE (an fp8 weight's row scales)
    res_out_ptr,               # [K] new residual, written by program 0 when HAS_RESIDUAL
    q_out_ptr,                 # [HEADS, HEAD_DIM]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    positions_ptr,             # [1] int64
    cos_sin_ptr,               # [max_pos, HEAD_DIM] float32: cos half | sin half
    slots_ptr,                 # [1] int64
    K, stride_wn, eps,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC: tl.constexpr, MMA_ROWS: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid * PAIRS // HALF                       # every pair of the program is in it
    i = (pid * PAIRS) % HALF + tl.arange(0, PAIRS)   # [PAIRS] column in the head's first half
    row_lo = (head * HEAD_DIM + i).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_lo = w_ptr + row_lo[:, None] * stride_wn
    w_hi = w_ptr + (row_lo + HALF)[:, None] * stride_wn
    acc_lo = gemv_acc_init(PAIRS, BLOCK_K, VEC, MMA_ROWS)
    acc_hi = gemv_acc_init(PAIRS, BLOCK_K, VEC, MMA_ROWS)
    sq = tl.zeros([BLOCK_K], tl.float32)
    res_end = tl.where(pid == 0, K, 0)   # program 0 writes the new residual, the rest do not
    # The epilogue's loads first: their latency (position -> cos/sin, slot) then hides behind
    # the weight stream instead of following it.
    pos = tl.load(positions_ptr)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + i)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + i)
    slot = tl.load(slots_ptr)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offs_k
        x, x_sq = input_tile(h_ptr, res_ptr, g_ptr, res_out_ptr, cols, K, res_end, 1,
                             HAS_RESIDUAL)
        sq += x_sq
        k_mask = (cols < K)[None, :]
        acc_lo = gemv_acc(acc_lo, tl.load(w_lo + cols[None, :], mask=k_mask, other=0.0), x,
                          VEC, MMA_ROWS)
        acc_hi = gemv_acc(acc_hi, tl.load(w_hi + cols[None, :], mask=k_mask, other=0.0), x,
                          VEC, MMA_ROWS)
    rstd = tl.rsqrt(tl.sum(sq, 0) / K + eps)
    lo = gemv_sum(acc_lo, MMA_ROWS) * rstd
    hi = gemv_sum(acc_hi, MMA_ROWS) * rstd
    if HAS_SCALE:
        lo *= tl.load(scale_ptr + row_lo)
        hi *= tl.load(scale_ptr + row_lo + HALF)
    if HAS_BIAS:
        lo += tl.load(bias_ptr + row_lo).to(tl.float32)
        hi += tl.load(bias_ptr + row_lo + HALF).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    lo = lo.to(dtype).to(tl.float32)   # the qkv projection's output, as the unfused path has it
    hi = hi.to(dtype).to(tl.float32)

    hb = i * 0 + head                    # [PAIRS] broadcast of the program's head
    rotate = hb < HEADS + KV_HEADS       # q and k heads; v heads are stored as they are
    out_lo = tl.where(rotate, (lo * cos - hi * sin).to(dtype), lo.to(dtype))
    out_hi = tl.where(rotate, (hi * cos + lo * sin).to(dtype), hi.to(dtype))

    is_q = hb < HEADS
    tl.store(q_out_ptr + head * HEAD_DIM + i, out_lo, mask=is_q)
    tl.store(q_out_ptr + head * HEAD_DIM + HALF + i, out_hi, mask=is_q)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    row = tl.maximum(slot, 0) % BLOCK_SIZE
    kv_head = tl.maximum(head - HEADS, 0) % KV_HEADS
    has_slot = (i * 0 + slot) >= 0       # a padding row (slot -1) writes nothing
    is_k = (hb >= HEADS) & rotate & has_slot
    is_v = (hb >= HEADS + KV_HEADS) & has_slot
    kv_ty = k_cache_ptr.dtype.element_ty
    kv_lo = cache_value(out_lo, kv_ty)
    kv_hi = cache_value(out_hi, kv_ty)
    k_row = k_cache_ptr + block * stride_kcb + row * stride_kct + kv_head * stride_kch
    tl.store(k_row + i, kv_lo, mask=is_k)
    tl.store(k_row + HALF + i, kv_hi, mask=is_k)
    v_row = v_cache_ptr + block * stride_vcb + row * stride_vct + kv_head * stride_vch
    tl.store(v_row + i, kv_lo, mask=is_v)
    tl.store(v_row + HALF + i, kv_hi, mask=is_v)


def qkv_config(n: int, k: int, num_sms: int, fp8: bool = False) -> SkinnyConfig:
    """The plain GEMV's launch parameters with 256-wide K tiles in 3 stages: a program keeps two
    accumulators (rows i and i + head_dim / 2), twice the registers of the plain GEMV's one. On
    the H200, llama-3-8b qkv (bench/gpu_matmul.py --fused, two runs): 15.8 us against 16.8 with
    4 stages and 17.2 with 512-wide tiles (the plain GEMV's), 15.9 vs 16.3 in the other run.
    An fp8 weight (half the bytes a tile) takes 512-wide tiles: 9.4 us against 12.1
    (bench/gpu_fp8.py --sweep, 2026-12-02)."""
    cfg = default_config(n, k, 1, num_sms)
    return cfg._replace(block_k=min(512 if fp8 else 256, cfg.block_k), num_stages=3)


def _pairs(n: int, k: int, head_dim: int, device: torch.device,
           config: SkinnyConfig | None = None, fp8: bool = False) -> tuple[int, SkinnyConfig]:
    cfg = config or qkv_config(n, k, processor_count(device), fp8)
    return min(cfg.block_n // 2, head_dim // 2), cfg


def supports_qkv(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 num_heads: int, num_kv_heads: int, head_dim: int, *, fp8: bool = False) -> bool:
    """Whether norm_qkv_rotary_store serves this batch-1 step: skinny_gemm.supports at M == 1,
    a weight of (num_heads + 2 * num_kv_heads) * head_dim rows, and head_dim / 2 a multiple of
    the pairs a program takes (powers of two)."""
    if not skinny_gemm.supports(h, weight, bias, max_m=1, fp8=fp8):
        return False
    n = weight.shape[0]
    if head_dim % 2 or n != (num_heads + 2 * num_kv_heads) * head_dim:
        return False
    pairs, _ = _pairs(n, weight.shape[1], head_dim, h.device)
    return pairs >= 1 and (head_dim // 2) % pairs == 0


def norm_qkv_rotary_store(
    h: torch.Tensor,                 # [1, K]
    residual: torch.Tensor | None,   # [1, K], h's dtype
    norm_weight: torch.Tensor,       # [K]
    eps: float,
    weight: torch.Tensor,            # [(heads + 2 * kv_heads) * head_dim, K], h's dtype or fp8
    bias: torch.Tensor | None,       # [N] or None
    positions: torch.Tensor,         # [1] int64
    cos_sin: torch.Tensor,           # [max_pos, head_dim] float32: cos half | sin half
    k_cache: torch.Tensor,           # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,      # [1] int64; negative: write nothing to the cache
    num_heads: int,
    config: SkinnyConfig | None = None,  # launch parameters (rows = 2 x pairs); None: default
    weight_scale: torch.Tensor | None = None,  # [N] float32: weight is fp8
) -> tuple[torch.Tensor, torch.Tensor]:   # rotated q [1, heads, head_dim], new residual [1, K]
    """fused_gemv.norm_linear(h, residual, ...) of the qkv weight, then
    kv_store.rotary_store_kv of its q, k and v, in one launch (see the module docstring)."""
    dev = h.device
    k = weight.shape[-1]
    check_tensor("h", h, shape=(1, k), dtypes=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, dim=4, dtypes=KV_DTYPES, device=dev)
    _, block_size, kvh, d = k_cache.shape
    check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=KV_DTYPES, device=dev)
    n = (num_heads + 2 * kvh) * d
    skinny_gemm.check_weight(weight, weight_scale, h.dtype, dev)
    check_tensor("weight", weight, shape=(n, k))
    if bias is not None:
        check_tensor("bias", bias, shape=(n,), dtypes=(h.dtype,), device=dev)
    check_tensor("norm_weight", norm_weight, shape=(k,), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("positions", positions, shape=(1,), dtypes=(torch.int64,), device=dev)
    check_tensor("cos_sin", cos_sin, shape=(None, d), dtypes=(torch.float32,), device=dev)
    check_tensor("slot_mapping", slot_mapping, shape=(1,), dtypes=(torch.int64,), device=dev)
    if not cos_sin.is_contiguous():
        raise ValueError("cos_sin: must be contiguous")
    pairs, cfg = _pairs(n, k, d, dev, config, weight_scale is not None)
    if d % 2 or (d // 2) % pairs:
        raise ValueError(f"head_dim {d}: half of it must be a multiple of {pairs}")
    check_gemv_reduction(cfg._replace(block_n=pairs), weight_scale is not None)
    res_out = None
    if residual is not None:
        check_tensor("residual", residual, shape=(1, k), dtypes=(h.dtype,), device=dev)
        res_out = torch.empty_like(h)
    q = torch.empty(1, num_heads, d, dtype=h.dtype, device=dev)
    _norm_qkv_rotary_kernel[(n // 2 // pairs,)](
        h, residual if residual is not None else h, norm_weight, weight,
        bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight,
        res_out if res_out is not None else h, q,
        k_cache, v_cache, positions, cos_sin, slot_mapping,
        k, weight.stride(0), eps,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=num_heads, KV_HEADS=kvh, HEAD_DIM=d, BLOCK_SIZE=block_size,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None, PAIRS=pairs, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, VEC=cfg.vec, MMA_ROWS=cfg.mma_rows, num_warps=cfg.num_warps,
    )
    return q, (res_out if res_out is not None else h)
