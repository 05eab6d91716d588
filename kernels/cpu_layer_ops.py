"""A decoder layer's element-wise ops on the CPU in one pass each (cpu_layer_ops.cpp): the
residual add with the RMS norm, silu(gate) * up, and rotary on q and k with the K/V store. The
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
from kernels.cpu_build import cpu_tag, load

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
             ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
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


# Rows bf16_linear_f32 takes (the kernel's limit).
BF16_LINEAR_MAX_ROWS = 8


@functools.cache
def bf16_dot_available() -> bool:
    """bf16_linear_f32 runs here (the CPU has AVX-512 BF16 and the ops built for it)."""
    return available() and bool(torch.ops.splitserve_cpu_layer.has_bf16_dot())


def bf16_linear_f32(x: torch.Tensor,  # [M, K] bf16, M <= BF16_LINEAR_MAX_ROWS, K % 32 == 0
                    w: torch.Tensor,  # [N, K] bf16, contiguous
                    ) -> torch.Tensor:  # [M, N] float32
    """x @ w.T in float32 (as F.linear of the operands widened: the products are exact, only
    the order of the sum differs): a bf16 model's logits at a few rows, reading the bf16 table
    instead of a float32 copy of it."""
    return torch.ops.splitserve_cpu_layer.bf16_linear_f32(x, w)


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
