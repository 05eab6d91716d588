"""Skinny GEMM: out = x @ weight.T (+ bias) for few rows of x, streaming the weight once.

At batch-1 decode a projection is a matrix-vector product: the time is the time to read the
weight [N, K] from DRAM, and cuBLAS leaves much of the bandwidth unused at these shapes. Here one
program owns BLOCK_N rows of the weight (BLOCK_N output columns) and walks K in BLOCK_K tiles,
the loads pipelined `num_stages` deep, so every weight byte is read once and each program keeps
several tiles in flight. Two ways to multiply a tile, chosen by `block_m`:

    block_m == 1 (M == 1 only): multiply-add on the CUDA cores into a [BLOCK_N, BLOCK_K] float32
                 tile, summed over K once at the end (no cross-thread reduction in the loop).
    block_m >= 16: tl.dot of x [BLOCK_M, BLOCK_K] (rows past M masked, never read) with the
                 weight tile; the tensor cores' padding costs no memory traffic.

Every program re-reads its x tiles (from L2): about M / BLOCK_N of the weight's bytes, which is
why wider rows suit larger M. Where N / BLOCK_N programs are too few to fill the GPU, split-K
(a second grid axis over whole K tiles) lets each program write a float32 partial into a
workspace [split_k, M, N] allocated with the output (every element written, so never zeroed;
capture-safe like any allocation from torch's caching allocator), and a second launch sums the
splits, adds the bias and rounds. With split_k == 1 one launch writes the output directly.

Arithmetic: float32 accumulation, bias added in float32, one rounding to x's dtype (as F.linear
on CUDA). An FP8 (e4m3fn) weight with one float32 scale per row (`weight_scale`, the
--quantization fp8 layout) streams half the bytes: each tile is widened to float32 (to x's dtype
for tl.dot) and the row's sum multiplied by its scale before the bias (kernels.torch_ops.linear
of the dequantized weight, up to the order of the float32 products). The grid depends on shapes only, so calls can be captured in a CUDA graph.

At M == 1 an fp8 weight's bytes come twice as fast as a 16-bit one's for the same work a
weight element (widen, multiply, add), so each byte costs twice the instructions (sm_90
SASS of the fused norm GEMV, triton 3.6: 5.1 instructions a weight element in the loop, ~2.5 of
them the widening and the FMA, the rest the input's prologue shared by only 4 rows a thread).
Two cheaper ways to sum a tile, chosen by the config (gemv_acc below):

    vec > 1:    each thread sums its `vec` contiguous products of a row before the accumulator
                (an FMA chain), so the accumulator is [BLOCK_N, BLOCK_K / vec] and a program can
                hold more rows, over which the input's cost is shared (3.5-4 a weight element).
    mma_rows:   the tensor cores (tl.dot) with the weight widened to fp16 (exact: e4m3 is a
                subset of fp16) and x split into two fp16 rows, hi = fp16(x / 2^16) and
                lo = fp16(x - hi * 2^16), so that hi * 2^16 + lo holds x to ~22 bits and any
                |x| below 4e9 (fp16 alone would overflow at 65504); out = 2^16 * (w . hi) +
                (w . lo), every product exact, summed in float32 (2.1-2.8 a weight element).

Measured on the H200 (bench/gpu_fp8.py --sweep gemv, weights from DRAM, 2026-12-03, fraction of
copy): vec 16 on 64 x 256 tiles takes norm + gate|up from 0.78 to 0.87 (the default there now);
for o, act + down and qkv (4096-6144 rows) no form beat the tile accumulator by more than 1.5%
(0.58, 0.77, 0.57).
The tensor cores were slower at every shape (0.07-0.83; best gate|up on 64 x 256) despite
fewer instructions; not profiled: the SASS stores x's rows to shared memory every tile, and
their wide tiles leave few programs for 4096 rows. The tile accumulator stays the default there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor, multiprocessors

MAX_M = 32        # rows the launcher accepts
# Rows supports() admits by default. The H200 sweep of 2026-11-30 (bench/RESULTS.md): at M=1
# this kernel beat cuBLAS on every 8B projection (o 0.73 vs 0.62 of the weight-read floor, qkv
# 0.81 vs 0.75, down 0.92 vs 0.86, lm_head 1.04 vs 0.92, gate_up 0.94 vs 0.93); at M=4 and 16
# its best configs only tied cuBLAS on qkv/o/lm_head and lost on gate_up/down.
SKINNY_M = 1
H200_SMS = 132    # the multiprocessor count assumed off-GPU (the interpreter)
_SUM_BLOCK = 1024


class SkinnyConfig(NamedTuple):
    block_m: int          # 1: CUDA-core path (M == 1); >= 16 and >= M: tl.dot path
    block_n: int          # weight rows (output columns) per program
    # K per loop step. On the CUDA-core path keep it >= 64 * num_warps: with fewer than two x
    # elements a thread, triton 3.9 loads x unvectorised and unpipelined, and lays the whole
    # tile out one element a thread (seen in its TTGIR for sm_90).
    block_k: int
    split_k: int = 1      # programs along K; > 1 adds a float32 workspace and a second launch
    num_warps: int = 4
    num_stages: int = 4   # loop pipelining depth (tiles in flight per program: num_stages - 1)
    # M == 1 only (gemv_acc): products a thread sums along K before the accumulator (1: the
    # [BLOCK_N, BLOCK_K] tile accumulator), or with mma_rows (16 or 64: the A operand's rows)
    # the tensor cores on an fp8 weight, x split into fp16 hi / lo rows.
    vec: int = 1
    mma_rows: int = 0


def default_config(n: int, k: int, m: int, num_sms: int = H200_SMS, *,
                   fp8: bool = False) -> SkinnyConfig:
    """Launch parameters for out[m, n] = x[m, k] @ w[n, k].T (sweep: bench/gpu_matmul.py).

    Aim: at least 1.5 programs per multiprocessor. M == 1: 16 rows (fewer for small N) of
    512-wide tiles. tl.dot: 4 * M rows (the x re-reads stay under a quarter of the weight's
    bytes), at least 16 and at most 64; x and weight tiles of at most 24 KB together; then
    split-K in powers of two (up to 8, each split at least four tiles) until there are enough
    programs. An fp8 weight at M == 1 with K >= 8192 takes 1024-wide tiles (H200 sweep,
    bench/gpu_fp8.py --sweep, 2026-12-02: llama-3-8b down 18.0 us against 21.8 with 512; at
    K = 4096, o and gate|up, 512 stayed best). An fp8 weight of K < 8192 with rows for three
    programs of 64 a multiprocessor takes 64 rows of 256-wide tiles summed 16 products at a
    time (vec; H200, weights from DRAM, 2026-12-03: llama-3-8b norm + gate|up 32.4 us, 0.85 of
    copy, against 35.9 and 0.77; the engine's batch-1 fp8 step 87 us shorter)."""
    want = 3 * num_sms // 2
    if m == 1 and fp8 and k < 8192 and cdiv(n, 64) >= 3 * num_sms:
        return SkinnyConfig(1, 64, min(256, _pow2_at_least(k, 16)), num_stages=3, vec=16)
    if m == 1:
        block_n = 16
        while block_n > 4 and cdiv(n, block_n) < want:
            block_n //= 2
        width = 1024 if fp8 and k >= 8192 else 512
        return SkinnyConfig(1, block_n, min(width, _pow2_at_least(k, 16)))
    block_m = _pow2_at_least(m, 16)
    block_n = min(64, _pow2_at_least(4 * m, 16))
    block_k = min(256, _pow2_at_most(12288 // (block_m + block_n)), _pow2_at_least(k, 16))
    split_k = 1
    while (cdiv(n, block_n) * split_k < want and split_k < 8
           and cdiv(k, block_k) >= 8 * split_k):
        split_k *= 2
    return SkinnyConfig(block_m, block_n, block_k, split_k)


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


# (One return each: triton 3.6 traces every return of a jit function, constexpr branches too.)
@triton.jit
def gemv_acc_init(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                  MMA_ROWS: tl.constexpr):
    """The M == 1 accumulator: [MMA_ROWS, BLOCK_N] (tensor cores) or [BLOCK_N, BLOCK_K / VEC]."""
    if MMA_ROWS > 0:
        acc = tl.zeros([MMA_ROWS, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    return acc


@triton.jit
def gemv_acc(acc, w, x, VEC: tl.constexpr, MMA_ROWS: tl.constexpr):
    """acc plus the products of the weight tile w [BLOCK_N, BLOCK_K] (any float dtype; fp8 with
    MMA_ROWS) with x [BLOCK_K] (float32), in the accumulator's form (module docstring)."""
    if MMA_ROWS > 0:
        hi = (x * (1.0 / 65536.0)).to(tl.float16)
        lo = (x - hi.to(tl.float32) * 65536.0).to(tl.float16)
        row = tl.arange(0, MMA_ROWS)[:, None]
        xa = tl.where(row == 0, hi[None, :], tl.where(row == 1, lo[None, :], 0.0))
        out = tl.dot(xa.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
    elif VEC == 1:
        out = acc + w.to(tl.float32) * x[None, :]
    else:
        p = w.to(tl.float32) * x[None, :]
        out = acc + tl.sum(tl.reshape(p, [p.shape[0], p.shape[1] // VEC, VEC]), 2)
    return out


@triton.jit
def gemv_sum(acc, MMA_ROWS: tl.constexpr):
    """The accumulator's row sums [BLOCK_N] in float32: 2^16 * hi's + lo's with MMA_ROWS."""
    if MMA_ROWS > 0:
        row = tl.arange(0, MMA_ROWS)[:, None]
        out = tl.sum(tl.where(row == 0, acc * 65536.0, tl.where(row == 1, acc, 0.0)), 0)
    else:
        out = tl.sum(acc, 1)
    return out


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,                 # [M, K]
    w_ptr,                 # [N, K]
    bias_ptr,              # [N], read when HAS_BIAS and SPLIT_K == 1
    scale_ptr,             # [N] float32, read when HAS_SCALE (an fp8 weight's row scales)
    out_ptr,               # [M, N], written when SPLIT_K == 1
    part_ptr,              # [SPLIT_K, M, N] float32, written when SPLIT_K > 1
    M, N, K,
    k_per_split,           # a multiple of BLOCK_K
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    VEC: tl.constexpr, MMA_ROWS: tl.constexpr,
):
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm   # [BLOCK_M, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn   # [BLOCK_N, 1]
    if BLOCK_M == 1:
        acc = gemv_acc_init(BLOCK_N, BLOCK_K, VEC, MMA_ROWS)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None], other=0.0)
        else:
            k_mask = cols < K
            x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
        if BLOCK_M == 1 and VEC == 1 and MMA_ROWS == 0:
            acc += w.to(tl.float32) * x.to(tl.float32)   # [BLOCK_N, BLOCK_K] * [1, BLOCK_K]
        elif BLOCK_M == 1:
            acc = gemv_acc(acc, w, tl.reshape(x, [BLOCK_K]).to(tl.float32), VEC, MMA_ROWS)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    res = gemv_sum(acc, MMA_ROWS)[None, :] if BLOCK_M == 1 else acc   # [BLOCK_M, BLOCK_N]
    if HAS_SCALE:
        res = res * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            res += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=mn_mask)
    else:
        rows = (pid_k * M + offs_m).to(tl.int64)
        tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], res, mask=mn_mask)


@triton.jit
def _sum_splits_kernel(
    part_ptr,              # [SPLIT_K, M * N] float32
    bias_ptr,              # [N], read when HAS_BIAS
    out_ptr,               # [M * N]
    MN, N,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def processor_count(device: torch.device) -> int:
    return multiprocessors(device) or H200_SMS


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             max_m: int = SKINNY_M, *, fp8: bool = False) -> bool:
    """Whether skinny_linear should serve F.linear(x, weight, bias) (else: fall back to it).

    CUDA, 16-bit floats of one dtype (fp8: an e4m3fn weight, whose scale the caller has), x
    [M, K] with 1 <= M <= max_m, K a multiple of 16, unit last strides, a [N] bias, and no
    autograd (the kernel has no backward)."""
    return (x.is_cuda and x.dim() == 2 and weight.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == (torch.float8_e4m3fn if fp8 else x.dtype)
            and weight.device == x.device
            and 1 <= x.shape[0] <= min(max_m, MAX_M) and x.shape[1] == weight.shape[1]
            and x.shape[1] % 16 == 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.dtype == x.dtype
                                  and bias.device == x.device and bias.stride(0) == 1))
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad
                          or (bias is not None and bias.requires_grad))))


def skinny_linear(x: torch.Tensor,                   # [M, K], M <= MAX_M
                  weight: torch.Tensor,              # [N, K], x's dtype
                  bias: torch.Tensor | None = None,  # [N], x's dtype
                  *, weight_scale: torch.Tensor | None = None,  # [N] float32: weight is fp8
                  config: SkinnyConfig | None = None,
                  ) -> torch.Tensor:                 # [M, N], x's dtype
    """Same as torch_ops.linear (F.linear with float32 accumulation) of the weight (times
    weight_scale's rows: an fp8 weight); see supports() for when it beats cuBLAS. Allocates
    the output, and with split_k > 1 a float32 workspace."""
    dev = x.device
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    check_weight(weight, weight_scale, x.dtype, dev)
    check_tensor("weight", weight, shape=(None, k))
    n = weight.shape[0]
    if bias is not None:
        check_tensor("bias", bias, shape=(n,), dtypes=(x.dtype,), device=dev)
    if m > MAX_M:
        raise ValueError(f"x: {m} rows, more than the {MAX_M} this kernel serves (use F.linear)")
    cfg = config or default_config(n, k, m, processor_count(dev), fp8=weight_scale is not None)
    _check_config(cfg, m, fp8=weight_scale is not None)
    out = torch.empty(m, n, dtype=x.dtype, device=dev)
    if m == 0 or n == 0:
        return out
    k_per_split = cdiv(cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    part = (torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=dev)
            if cfg.split_k > 1 else out)
    _skinny_gemm_kernel[(cdiv(n, cfg.block_n), cfg.split_k)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out, part,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None, NUM_STAGES=cfg.num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        VEC=cfg.vec, MMA_ROWS=cfg.mma_rows, num_warps=cfg.num_warps,
    )
    if cfg.split_k > 1:
        _sum_splits_kernel[(cdiv(m * n, _SUM_BLOCK),)](
            part, bias if bias is not None else weight, out, m * n, n,
            SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK=_SUM_BLOCK, num_warps=4)
    return out


def check_weight(weight: torch.Tensor, weight_scale: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
    """weight [N, K] in dtype, or fp8 e4m3fn with its [N] float32 row scales."""
    if weight_scale is None:
        check_tensor("weight", weight, dim=2, dtypes=(dtype,), device=device)
        return
    check_tensor("weight", weight, dim=2, dtypes=(torch.float8_e4m3fn,), device=device)
    check_tensor("weight_scale", weight_scale, shape=(weight.shape[0],),
                 dtypes=(torch.float32,), device=device)


def _check_config(cfg: SkinnyConfig, m: int, *, fp8: bool = False) -> None:
    def pow2(v: int) -> bool:
        return v >= 1 and v & (v - 1) == 0

    check_gemv_reduction(cfg, fp8)

    if not all(pow2(v) for v in (cfg.block_m, cfg.block_n, cfg.block_k)):
        raise ValueError(f"{cfg}: block sizes must be powers of two")
    if cfg.block_m == 1:
        if m > 1:
            raise ValueError(f"{cfg}: block_m 1 serves one row, x has {m}")
    elif cfg.block_m < max(m, 16) or cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"{cfg}: tl.dot needs block_m >= max(M={m}, 16), block_n and block_k "
                         ">= 16")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"{cfg}: split_k, num_warps and num_stages must be >= 1")


def check_gemv_reduction(cfg: SkinnyConfig, fp8: bool) -> None:
    """vec and mma_rows (gemv_acc): vec a power of two dividing block_k; mma_rows 0, or 16 or
    64 for an fp8 weight at block_m 1, with block_n and block_k >= 16."""
    if cfg.vec < 1 or cfg.vec & (cfg.vec - 1) or cfg.block_k % cfg.vec:
        raise ValueError(f"{cfg}: vec must be a power of two dividing block_k")
    if cfg.mma_rows not in (0, 16, 64):
        raise ValueError(f"{cfg}: mma_rows must be 0, 16 or 64")
    if cfg.mma_rows and (not fp8 or cfg.block_m != 1 or cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"{cfg}: mma_rows serves an fp8 weight at block_m 1, block_n and "
                         "block_k >= 16")
    if cfg.vec > 1 and cfg.block_m != 1:
        raise ValueError(f"{cfg}: vec serves block_m 1")
