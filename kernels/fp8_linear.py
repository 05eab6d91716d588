"""FP8 projections on Hopper: x quantized per token by a Triton kernel, then torch._scaled_mm with
row-wise scales (cuBLASLt's nvjet kernels on sm_90 under torch 2.11), as vLLM's online fp8 does:

    xq[m], xs[m] = x[m] / (amax(|x[m]|) / 448) in e4m3fn, amax(|x[m]|) / 448   (one program a row)
    out[m, n]    = (sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n] (+ bias[n])      (_scaled_mm)

The weight is quantized once at load (kernels.torch_ops.quantize_rows: one scale per output
channel); its [N, K] row-major storage is the column-major [K, N] operand _scaled_mm wants, so
no copy is made. The reference is kernels.torch_ops.fp8_linear (the same quantization, float32
arithmetic on the fp8 values). Where a norm or an activation comes first, it quantizes its own
output in the same launch (kernels.norm_act.rms_norm_fp8, silu_and_mul_fp8) and the GEMM runs
as fp8_linear_prequantized, with no quantization launch of its own (H200, M = 256: SiLU-and-mul
+ down 45.6 us against 48.7 in turn, norm + gate|up 64.5 against 64.7; bench/RESULTS.md
"eighth session, issue 19").

`fast_accum` (the default): `use_fast_accum`, the sum over K kept in the tensor cores'
accumulators (as vLLM's cutlass_scaled_mm does), where torch's default has cuBLASLt promote
partial sums into a second float32 set. H200, two calls (bench/RESULTS.md "twelfth session,
issue 19"): M = 256 gate|up 1.03-1.09x, down 1.02-1.08x, qkv and o within 1%; M = 8192 o
1.15-1.17x, gate|up and down 1.02-1.10x, qkv 0.96-1.00x; the engine's batch-256 graph 2.4% and
2.7% faster (9.97 -> 9.74 ms, 10.04 -> 9.77). Against float32 arithmetic on the same fp8
values the error grows from 1.7e-3 rms relative (the bf16 output's rounding) to 2.1e-3 at
K = 4096 and 3.3e-3 at K = 14336, a tenth of what per-token W8A8 quantization itself costs
(~3e-2).

Batch-1 projections do not come here: they stream the fp8 weight through the GEMVs
(kernels.skinny_gemm, fused_gemv, fused_qkv with weight_scale), whose activations stay in the
model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.checks import check_tensor, next_pow2
from kernels.torch_ops import FP8, FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _quantize_rows_kernel(
    x_ptr,        # [M, K]
    q_ptr,        # [M, K] fp8 e4m3fn
    scale_ptr,    # [M] float32
    K, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr, FMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0) / FMAX, MIN_SCALE)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor,  # [M, K], 16- or 32-bit float
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] fp8, [M, 1] float32
    """kernels.torch_ops.quantize_rows in one launch (the whole row in one program)."""
    check_tensor("x", x, dim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = next_pow2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=block,
                                    FMAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                                    num_warps=min(16, max(1, block // 512)))
    return q, scale


def supports(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether fp8_linear serves x [M, K] on this weight: CUDA, bf16 x (row-wise scales give
    bf16 out), K and N multiples of 16 (cuBLASLt's FP8 rule)."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16
            and qweight.dtype == FP8 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1]
            and x.shape[1] % 16 == 0 and qweight.shape[0] % 16 == 0 and x.stride(1) == 1
            and qweight.is_contiguous())


def fp8_linear(x: torch.Tensor,                   # [M, K] bf16
               qweight: torch.Tensor,             # [N, K] fp8 e4m3fn, row-major
               weight_scale: torch.Tensor,        # [N] float32
               bias: torch.Tensor | None = None,  # [N], x's dtype
               *, fast_accum: bool = True,
               ) -> torch.Tensor:                 # [M, N], x's dtype
    """W8A8 linear (the module docstring); see supports() for the shapes it takes."""
    n, k = qweight.shape
    check_tensor("weight_scale", weight_scale, shape=(n,), dtypes=(torch.float32,),
                 device=x.device)
    if not supports(x, qweight):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(qweight.shape)} {qweight.dtype}: see supports()")
    xq, xs = quantize_per_token(x)
    return fp8_linear_prequantized(xq, xs, qweight, weight_scale, bias, x.dtype,
                                   fast_accum=fast_accum)


def fp8_linear_prequantized(xq: torch.Tensor,                 # [M, K] fp8 e4m3fn
                            xs: torch.Tensor,                 # [M, 1] float32
                            qweight: torch.Tensor,            # [N, K] fp8 e4m3fn, row-major
                            weight_scale: torch.Tensor,       # [N] float32
                            bias: torch.Tensor | None,        # [N], out_dtype
                            out_dtype: torch.dtype = torch.bfloat16,
                            *, fast_accum: bool = True,
                            ) -> torch.Tensor:                # [M, N] out_dtype
    """fp8_linear's GEMM on activations already quantized per token (by the kernel before it:
    kernels.norm_act.rms_norm_fp8, silu_and_mul_fp8). `fast_accum`: the module docstring."""
    n = qweight.shape[0]
    out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=weight_scale.view(1, n),
                           out_dtype=out_dtype, use_fast_accum=fast_accum)
    return out if bias is None else out.add_(bias)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Tiles of scaled_mm_triton. Its reason to exist: cuBLASLt's 128 x 128 tiles give M = 256
    and N = 4096 (o, down) 64 tiles for the H200's 132 multiprocessors, qkv 96 (twelfth
    session's profile: o 14.3 us, down 38.4, against 6.6 and 23 at the fp8 rate); 64-row
    tiles give them 128 and 192. Not yet timed on a GPU: bench/gpu_fp8_step.py --part tgemm."""
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8       # row tiles that share a column of the weight, for L2 reuse
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _scaled_mm_kernel(
    a_ptr,                 # [M, K] fp8 e4m3fn, row-major
    b_ptr,                 # [N, K] fp8 e4m3fn, row-major (the weight)
    c_ptr,                 # [M, N]
    a_scale_ptr,           # [M] float32
    b_scale_ptr,           # [N] float32
    bias_ptr,              # [N] or a dummy
    M, N, K, stride_am, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """c = (a @ b^T) * a_scale[:, None] * b_scale[None, :] (+ bias); K a multiple of BLOCK_K.
    Tiles are taken GROUP_M row tiles at a time down each column of tiles."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    acc *= tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scaled_mm_triton(xq: torch.Tensor,                 # [M, K] fp8 e4m3fn
                     xs: torch.Tensor,                 # [M, 1] float32
                     qweight: torch.Tensor,            # [N, K] fp8 e4m3fn, row-major
                     weight_scale: torch.Tensor,       # [N] float32
                     bias: torch.Tensor | None = None,  # [N]
                     out_dtype: torch.dtype = torch.bfloat16,
                     config: GemmConfig | None = None,
                     ) -> torch.Tensor:                # [M, N] out_dtype
    """fp8_linear_prequantized's product in a Triton kernel (float32 accumulation over the
    whole K, as fast_accum's), for shapes where cuBLASLt's tiles leave multiprocessors idle."""
    config = config or GemmConfig()
    m, k = xq.shape
    n = qweight.shape[0]
    check_tensor("xq", xq, dim=2, dtypes=(FP8,))
    check_tensor("qweight", qweight, shape=(n, k), dtypes=(FP8,), device=xq.device)
    check_tensor("xs", xs, shape=(m, 1), dtypes=(torch.float32,), device=xq.device)
    check_tensor("weight_scale", weight_scale, shape=(n,), dtypes=(torch.float32,),
                 device=xq.device)
    if k % config.block_k:
        raise ValueError(f"scaled_mm_triton: K = {k} is not a multiple of {config.block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _scaled_mm_kernel[grid](
        xq, qweight, out, xs, weight_scale, bias if bias is not None else out,
        m, n, k, xq.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
