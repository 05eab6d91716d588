"""Fused RMSNorm (with the residual add of a pre-norm block) and SiLU-and-mul.

Both round where torch_ops.rms_norm / torch_ops.silu_and_mul round: x + residual in x's dtype;
the normalised row in x's dtype before a same-dtype weight multiplies it; silu(gate) in x's dtype
before the product with up.

The `_fp8` forms end with the per-token quantization of kernels.fp8_linear (the row rounded to
x's dtype first, then amax / 448 and e4m3), in the same launch, so the fp8 GEMM that follows
(fp8_linear.fp8_linear_prequantized) needs no quantization launch of its own: exactly
torch_ops.quantize_rows(rms_norm(...)) and quantize_rows(silu_and_mul(...)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.checks import FLOAT_DTYPES, check_tensor, next_pow2
from kernels.torch_ops import FP8, FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _store_row(y, out_ptr, scale_ptr, r, offs, mask, QUANT: tl.constexpr, FMAX: tl.constexpr,
               MIN_SCALE: tl.constexpr):
    """Row y (float32, already rounded to the model's dtype) to out: as it is, or quantized per
    token (out fp8 and its scale at scale_ptr[r])."""
    if QUANT:
        scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), 0) / FMAX, MIN_SCALE)
        y = tl.minimum(tl.maximum(y / scale, -FMAX), FMAX)
        tl.store(scale_ptr + r, scale)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,                 # [R, N]
    res_ptr,               # [R, N], read when HAS_RESIDUAL
    w_ptr,                 # [N]
    out_ptr,               # [R, N], x's dtype, or fp8 when QUANT
    res_out_ptr,           # [R, N], written when HAS_RESIDUAL
    scale_ptr,             # [R] float32, written when QUANT
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    WEIGHT_IN_X_DTYPE: tl.constexpr, QUANT: tl.constexpr = False, FMAX: tl.constexpr = 448.0,
    MIN_SCALE: tl.constexpr = 1.0,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + r * stride_r + offs, mask=mask,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + r * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if WEIGHT_IN_X_DTYPE:
        y = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    else:
        y = w.to(tl.float32) * normed
    y = y.to(x.dtype).to(tl.float32)
    _store_row(y, out_ptr + r * stride_o, scale_ptr, r, offs, mask, QUANT, FMAX, MIN_SCALE)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,                 # [R, 2 * N]: gate | up
    out_ptr,               # [R, N], x's dtype, or fp8 when QUANT
    scale_ptr,             # [R] float32, written when QUANT (then BLOCK >= N: one program a row)
    stride_x, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr = False,
    FMAX: tl.constexpr = 448.0, MIN_SCALE: tl.constexpr = 1.0,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + r * stride_x + N + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    _store_row(y, out_ptr + r * stride_o, scale_ptr, r, offs, mask, QUANT, FMAX, MIN_SCALE)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [R, N] view (a copy only if the leading dimensions cannot be merged)."""
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    if t.dim() == 0:
        raise ValueError(f"{name}: needs at least one dimension")
    return t.reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor,                   # [..., hidden]
             weight: torch.Tensor,              # [hidden]
             eps: float,
             residual: torch.Tensor | None = None,  # [..., hidden], x's dtype
             *,
             out: torch.Tensor | None = None,            # [..., hidden], x's dtype
             residual_out: torch.Tensor | None = None,   # [..., hidden]; may be residual
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as torch_ops.rms_norm: (normed, new_residual). With a residual, x + residual is
    normed and also written to residual_out (a new tensor unless given); without, the new
    residual is x itself."""
    out = torch.empty_like(x) if out is None else out
    check_tensor("out", out, shape=tuple(x.shape), dtypes=(x.dtype,), device=x.device)
    return out, _rms_norm(x, weight, eps, residual, out, residual_out, None)


def rms_norm_fp8(x: torch.Tensor,                   # [M, hidden], 16- or 32-bit float
                 weight: torch.Tensor,              # [hidden]
                 eps: float,
                 residual: torch.Tensor | None = None,  # [M, hidden], x's dtype
                 *,
                 residual_out: torch.Tensor | None = None,  # [M, hidden]; may be residual
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm, its output quantized per token in the same launch: (q [M, hidden] fp8,
    scale [M, 1] float32, new_residual), q * scale ~= rms_norm(...)[0]."""
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    return q, scale, _rms_norm(x, weight, eps, residual, q, residual_out, scale)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
              out: torch.Tensor, residual_out: torch.Tensor | None,
              scale: torch.Tensor | None) -> torch.Tensor:
    """The launch behind both: out (checked by the caller) quantized when scale is given;
    returns the new residual."""
    dev = x.device
    x2 = _rows("x", x)
    n = x.shape[-1]
    check_tensor("weight", weight, shape=(n,), dtypes=FLOAT_DTYPES, device=dev)
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,), device=dev)
        residual_out = torch.empty_like(x) if residual_out is None else residual_out
        check_tensor("residual_out", residual_out, shape=tuple(x.shape), dtypes=(x.dtype,),
                     device=dev)
    o2 = out.view(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    ro2 = residual_out.view(-1, n) if residual is not None else x2
    if x2.shape[0]:
        block = next_pow2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, o2, ro2, o2 if scale is None else scale,
            x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
            eps, N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
            WEIGHT_IN_X_DTYPE=weight.dtype == x.dtype, QUANT=scale is not None,
            FMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
            num_warps=min(16, max(1, block // 256)),
        )
    return residual_out if residual is not None else x


def _split_gate_up(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    x2 = _rows("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dimension {x.shape[-1]} is not 2 * n")
    return x2, x.shape[-1] // 2


def silu_and_mul(x: torch.Tensor,                      # [..., 2 * n]: gate | up
                 *, out: torch.Tensor | None = None,  # [..., n], x's dtype
                 ) -> torch.Tensor:                    # [..., n]
    """Same as torch_ops.silu_and_mul: silu(gate) * up."""
    x2, n = _split_gate_up(x)
    shape = (*x.shape[:-1], n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    check_tensor("out", out, shape=shape, dtypes=(x.dtype,), device=x.device)
    o2 = out.view(-1, n)
    block = min(1024, next_pow2(n))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, o2, o2, x2.stride(0), o2.stride(0), N=n, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_fp8(x: torch.Tensor,  # [M, 2 * n]: gate | up
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # [M, n] fp8, [M, 1] float32
    """silu_and_mul, its output quantized per token in the same launch (one program a row):
    q * scale ~= silu_and_mul(x)."""
    check_tensor("x", x, dim=2, dtypes=FLOAT_DTYPES)
    x2, n = _split_gate_up(x)
    q = torch.empty(x.shape[0], n, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    block = next_pow2(n)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], 1)](
            x2, q, scale, x2.stride(0), q.stride(0), N=n, BLOCK=block, QUANT=True,
            FMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, num_warps=min(16, max(4, block // 1024)))
    return q, scale
