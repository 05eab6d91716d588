"""A decoder layer's element-wise ops on the CPU in one pass each (cpu_layer_ops.cpp): the
residual add with the RMS norm, silu(gate) * up, and rotary on q and k with the K/V store; and
the projections' matmul at a few rows (small_linear, a decode step's tail). The
torch path runs each as 5-15 ops, every one an OpenMP region over both cores and a fresh
temporary; here a decode step's rows take one thread and no region. The references are
kernels.torch_ops.rms_norm, silu_and_mul, apply_rotary and store_kv
(tests/kernels/test_cpu_layer_ops.py compares them).

Built like kernels.cpu_decode_attention (kernels.cpu_build, -march=native; compiled without FMA
contraction, so that rotary rounds each product as the reference does). `available()` says whether it built and runs here.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from kernels import torch_ops
from kernels.cpu_build import cpu_tag, load, vector_move_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def available() -> bool:
    """The ops are built (now, if they were not) and give the references' results here."""
    if os.name != "posix" or not SOURCE.is_file():
        return False
    try:
        load(f"splitserve_cpu_layer_{cpu_tag()}", SOURCE,
             ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *vector_move_flags()])
        return _self_check()
    except (OSError, RuntimeError, ImportError, AssertionError) as e:
        log.warning("the CPU layer ops are not available (%s): the torch ops run instead",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w = torch.randn(40, generator=g)
    ok = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5)
             for a, b in zip(rms_norm(x, w, 1e-6, res), torch_ops.rms_norm(x, w, 1e-6, res),
                             strict=True))
    gu = torch.randn(3, 40, generator=g)
    return ok and torch.allclose(silu_and_mul(gu), torch_ops.silu_and_mul(gu), atol=1e-5,
                                 rtol=1e-5)


def serves(x: torch.Tensor) -> bool:
    """Whether the ops take x's dtype and device (else: the torch ops)."""
    return x.device.type == "cpu" and x.dtype in DTYPES and available()


def rms_norm(x: torch.Tensor,          # [T, H]
             weight: torch.Tensor,     # [H]
             eps: float,
             residual: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new residual: [T, H] each
    """torch_ops.rms_norm."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = None if residual is None else residual.reshape(-1, shape[-1])
    normed, new_res = torch.ops.splitserve_cpu_layer.rms_norm(x2, r2, weight, eps)
    return normed.view(shape), new_res.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2n] -> [..., n]
    """torch_ops.silu_and_mul."""
    out = torch.ops.splitserve_cpu_layer.silu_and_mul(x.reshape(-1, x.shape[-1]))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


@functools.cache
def small_linear_max_rows() -> int:
    """Rows small_linear takes in this build: 8 with AVX-512, any with AVX2 (0: none)."""
    return int(torch.ops.splitserve_cpu_layer.small_linear_max_rows()) if available() else 0


@functools.cache
def bf16_dot_available() -> bool:
    """small_linear takes bf16 here (AVX-512 BF16's dots, or AVX2's widened in registers)."""
    return available() and bool(torch.ops.splitserve_cpu_layer.has_bf16_dot())


def small_linear_dtype(dtype: torch.dtype) -> bool:
    """small_linear takes weights of dtype here."""
    return (dtype == torch.float32 and small_linear_max_rows() > 0
            or dtype == torch.bfloat16 and bf16_dot_available())


def small_linear_serves(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether small_linear takes x [M, K] and weight [N, K] at up to max_rows rows (default
    and at most: the build's limit)."""
    limit = small_linear_max_rows() if max_rows is None else min(max_rows,
                                                                 small_linear_max_rows())
    return (x.dim() == 2 and x.shape[0] <= limit and x.shape[1] % 32 == 0
            and x.dtype == weight.dtype and weight.is_contiguous() and x.stride(1) == 1
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and (x.dtype == torch.float32 and available()
                 or x.dtype == torch.bfloat16 and bf16_dot_available()))


def small_linear(x: torch.Tensor,       # [M, K], M <= small_linear_max_rows(), K % 32 == 0
                 weight: torch.Tensor,  # [N, K] in x's dtype, contiguous
                 float32_out: bool = False,
                 ) -> torch.Tensor:     # [M, N] in x's dtype, or float32
    """x @ weight.T with float32 sums (bf16 products are exact in float32, so float32_out gives
    F.linear of the widened operands but for the order of the sum): a decode step's
    projections and logits at a few rows, reading each weight once at memory speed."""
    return torch.ops.splitserve_cpu_layer.small_linear(x, weight, float32_out)


@functools.cache
def packed_linear_available() -> bool:
    return available() and bool(torch.ops.splitserve_cpu_layer.has_packed_linear())


def packed_linear(x: torch.Tensor,   # [M, K] float32, rows dense
                  wp: torch.Tensor,  # [ceil(N / 64), KP >= K, 64] float32: w [N, K] packed
                  n: int,
                  ) -> torch.Tensor:  # [M, N] float32
    """x @ w.T from w held as oneDNN packs a float32 weight for 64 rows (see the .cpp): a block
    of 64 columns a task, its rows one at a time, so the weights are read from memory once."""
    return torch.ops.splitserve_cpu_layer.packed_linear(x, wp, n)


def alias_storage(owner: torch.Tensor, ptr: int, numel: int) -> torch.Tensor:
    """numel float32s at ptr, owner's storage (an opaque oneDNN tensor), as a plain tensor that
    keeps owner alive."""
    return torch.ops.splitserve_cpu_layer.alias_storage(owner, ptr, numel)


def rotary_store(qkv: torch.Tensor,           # [T, (heads + 2 kv_heads) * head_dim]
                 heads: int, kv_heads: int,
                 positions: torch.Tensor,     # [T] int64
                 cos_sin: torch.Tensor,       # [max_pos, head_dim] float32: cos | sin halves
                 k_cache: torch.Tensor,       # [num_blocks, block_size, kv_heads, head_dim]
                 v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor,  # [T] int64; negative: not stored
                 ) -> torch.Tensor:           # rotated q: [T, heads, head_dim]
    """torch_ops.apply_rotary of q and k, then torch_ops.store_kv of k and v (the pools in
    qkv's dtype)."""
    return torch.ops.splitserve_cpu_layer.rotary_store(qkv, heads, kv_heads, positions, cos_sin,
                                                       k_cache, v_cache, slot_mapping)
