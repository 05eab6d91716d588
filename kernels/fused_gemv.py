"""Batch-1 projections with the op before them fused in: one launch where there were two.

At batch-1 decode every projection is a weight stream (kernels.skinny_gemm), and the small ops
between them (the residual add + RMSNorm before qkv and gate|up, SiLU-and-mul before down) are
launches of about 2 us each that move a few KB. Here the GEMV computes its own input while it
streams the weight, so those launches disappear:

    norm_linear:  out = rms_norm(h + residual) @ W.T (+ bias), and the new residual h + residual
    act_linear:   out = (silu(gate) * up) @ W.T (+ bias)

The norm needs the whole row's sum of squares, but every program walks the whole row (K) anyway,
so it folds the norm's scale out of the sum:

    out[n] = sum_k W[n, k] * v[k] * rstd * g[k] = rstd * sum_k W[n, k] * (v[k] * g[k])

with v = h + residual (rounded to h's dtype, as the unfused add stores it), g the norm weight and
rstd = 1 / sqrt(mean(v^2) + eps) from the same K loop. Rounding: the unfused path rounds v * rstd
and then (v * rstd) * g to h's dtype before the matmul; this path keeps them in float32 and rounds
once, at the output (so it is the more exact of the two; they differ by about one bf16 ulp of the
activations). act_linear rounds exactly where torch_ops.silu_and_mul does, so it matches the
unfused path bit for bit up to the float32 summation order.

An FP8 weight (e4m3fn, one float32 scale per row: --quantization fp8) is read as it is stored,
half the bytes, and each output multiplied by its row's scale before the bias (as
kernels.skinny_gemm does).

Program 0 alone writes the new residual (every program reads the old one, so it cannot be
updated in place). Launch parameters are skinny_gemm's for M == 1 unless a config is given
(bench/gpu_matmul.py --fused sweeps them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import skinny_gemm
from kernels.checks import FLOAT_DTYPES, cdiv, check_tensor
from kernels.skinny_gemm import (
    SkinnyConfig,
    check_gemv_reduction,
    default_config,
    gemv_acc,
    gemv_acc_init,
    gemv_sum,
    processor_count,
)

PROLOGUE_NORM = 1   # x = rms_norm(h + residual) * g
PROLOGUE_ACT = 2    # x = silu(gate) * up


@triton.jit
def input_tile(h_ptr, res_ptr, g_ptr, res_out_ptr, cols, K, res_end,
               PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The GEMV's input at columns `cols` in float32, and (norm) the squares of v = h +
    residual for the norm's sum; writes v to res_out_ptr at columns below res_end."""
    k_mask = cols < K
    if PROLOGUE == 1:
        v = tl.load(h_ptr + cols, mask=k_mask, other=0.0)
        if HAS_RESIDUAL:
            v = (v.to(tl.float32) + tl.load(res_ptr + cols, mask=k_mask,
                                            other=0.0).to(tl.float32)).to(v.dtype)
            tl.store(res_out_ptr + cols, v, mask=cols < res_end)
        vf = v.to(tl.float32)
        return vf * tl.load(g_ptr + cols, mask=k_mask, other=0.0).to(tl.float32), vf * vf
    gate = tl.load(h_ptr + cols, mask=k_mask, other=0.0)
    up = tl.load(h_ptr + K + cols, mask=k_mask, other=0.0)
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
    x = (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return x, x


@triton.jit
def _fused_gemv_kernel(
    h_ptr,                 # [K] (norm) or [2K] gate | up (act)
    res_ptr,               # [K], read when HAS_RESIDUAL
    g_ptr,                 # [K] norm weight (norm)
    w_ptr,                 # [N, K]
    bias_ptr,              # [N], read when HAS_BIAS
    scale_ptr,             # [N] float32, read when HAS_SCALE (an fp8 weight's row scales)
    out_ptr,               # [N]
    res_out_ptr,           # [K], written by program 0 when HAS_RESIDUAL
    N, K, stride_wn, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC: tl.constexpr, MMA_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn   # [BLOCK_N, 1]
    acc = gemv_acc_init(BLOCK_N, BLOCK_K, VEC, MMA_ROWS)
    sq = tl.zeros([BLOCK_K], tl.float32)
    res_end = tl.where(pid == 0, K, 0)   # program 0 writes the new residual, the rest do not
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offs_k
        x, x_sq = input_tile(h_ptr, res_ptr, g_ptr, res_out_ptr, cols, K, res_end,
                             PROLOGUE, HAS_RESIDUAL)
        if PROLOGUE == 1:
            sq += x_sq
        w = tl.load(w_rows + cols[None, :], mask=n_mask[:, None] & (cols < K)[None, :],
                    other=0.0)
        acc = gemv_acc(acc, w, x, VEC, MMA_ROWS)
    res = gemv_sum(acc, MMA_ROWS)
    if PROLOGUE == 1:
        res = res * tl.rsqrt(tl.sum(sq, 0) / K + eps)
    if HAS_SCALE:
        res = res * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        res += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty), mask=n_mask)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             fp8: bool = False) -> bool:
    """Whether norm_linear / act_linear serve x [1, K] (act: [1, 2K]) with this weight on the
    GPU: skinny_gemm.supports at M == 1, on the matmul's input width."""
    k = weight.shape[-1] if weight.dim() == 2 else -1
    return (x.dim() == 2 and x.shape[1] in (k, 2 * k)
            and skinny_gemm.supports(x[:, :k], weight, bias, max_m=1, fp8=fp8))


def _launch(prologue: int, h: torch.Tensor, residual: torch.Tensor | None,
            g: torch.Tensor | None, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, res_out: torch.Tensor | None,
            cfg: SkinnyConfig | None, weight_scale: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(1, n, dtype=h.dtype, device=h.device)
    cfg = cfg or default_config(n, k, 1, processor_count(h.device),
                                fp8=weight_scale is not None)
    if cfg.block_m != 1 or cfg.split_k != 1:
        raise ValueError(f"{cfg}: the fused GEMV takes block_m 1 and split_k 1")
    check_gemv_reduction(cfg, weight_scale is not None)
    _fused_gemv_kernel[(cdiv(n, cfg.block_n),)](
        h, residual if residual is not None else h, g if g is not None else h, weight,
        bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out,
        res_out if res_out is not None else h, n, k, weight.stride(0), eps,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        VEC=cfg.vec, MMA_ROWS=cfg.mma_rows, num_warps=cfg.num_warps,
    )
    return out


def _check(h: torch.Tensor, width: int, weight: torch.Tensor, bias: torch.Tensor | None,
           weight_scale: torch.Tensor | None) -> None:
    dev = h.device
    check_tensor("h", h, shape=(1, width), dtypes=FLOAT_DTYPES)
    skinny_gemm.check_weight(weight, weight_scale, h.dtype, dev)
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), dtypes=(h.dtype,), device=dev)


def norm_linear(h: torch.Tensor,                     # [1, K]
                residual: torch.Tensor | None,       # [1, K], h's dtype
                norm_weight: torch.Tensor,           # [K]
                eps: float,
                weight: torch.Tensor,                # [N, K], h's dtype or fp8
                bias: torch.Tensor | None = None,    # [N]
                *, weight_scale: torch.Tensor | None = None,  # [N] float32: weight is fp8
                config: SkinnyConfig | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:   # [1, N], new residual [1, K]
    """rms_norm(h, norm_weight, eps, residual) then linear, in one launch; returns (out,
    new_residual) where new_residual is h + residual (a new tensor), or h without a residual."""
    k = weight.shape[-1]
    _check(h, k, weight, bias, weight_scale)
    check_tensor("norm_weight", norm_weight, shape=(k,), dtypes=FLOAT_DTYPES, device=h.device)
    res_out = None
    if residual is not None:
        check_tensor("residual", residual, shape=(1, k), dtypes=(h.dtype,), device=h.device)
        res_out = torch.empty_like(h)
    out = _launch(PROLOGUE_NORM, h, residual, norm_weight, eps, weight, bias, res_out, config,
                  weight_scale)
    return out, (res_out if res_out is not None else h)


def act_linear(gate_up: torch.Tensor,             # [1, 2K]: gate | up
               weight: torch.Tensor,              # [N, K], gate_up's dtype or fp8
               bias: torch.Tensor | None = None,  # [N]
               *, weight_scale: torch.Tensor | None = None,  # [N] float32: weight is fp8
               config: SkinnyConfig | None = None,
               ) -> torch.Tensor:                 # [1, N]
    """silu_and_mul(gate_up) then linear, in one launch."""
    _check(gate_up, 2 * weight.shape[-1], weight, bias, weight_scale)
    return _launch(PROLOGUE_ACT, gate_up, None, None, 0.0, weight, bias, None, config,
                   weight_scale)
