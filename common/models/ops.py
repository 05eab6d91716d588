"""The ops a model layer calls (the element-wise ones and the projections' matmul), gathered so
that a device path can swap them.

The default is kernels.torch_ops and F.linear (plain torch, the CPU path); the CUDA path uses
common.models.ops_triton.TRITON_OPS, built from kernels' Triton kernels with the same signatures
and semantics. A projection's weight is a tensor or, under --quantization fp8, an Fp8Weight
(common.models.fp8); both op sets take either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.fp8 import reference_linear
from kernels import torch_ops

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None],
                   tuple[torch.Tensor, torch.Tensor]]
SiluAndMul = Callable[[torch.Tensor], torch.Tensor]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (h, residual, norm weight, eps, weight, bias) -> (linear(rms_norm(h + residual)), new residual)
NormLinear = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float, torch.Tensor,
                       torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
# (gate | up, weight, bias) -> linear(silu(gate) * up)
ActLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (num_heads, num_kv_heads, head_dim)
Heads = tuple[int, int, int]
# (h, residual, norm weight, eps, qkv weight, qkv bias, positions, cos_sin, k_cache, v_cache,
#  meta, backend, heads) -> (rotated q [T, heads, head_dim], new residual)
NormQkvRotaryStore = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float,
                               torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                               torch.Tensor, torch.Tensor, AttentionMetadata, AttentionBackend,
                               Heads], tuple[torch.Tensor, torch.Tensor]]
# (q, k, v, positions, cos_sin, k_cache, v_cache, meta, backend) -> rotated q
RotaryStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor, torch.Tensor, AttentionMetadata, AttentionBackend],
                       torch.Tensor]


@dataclass(frozen=True, slots=True)
class ModelOps:
    rms_norm: RmsNorm          # (x, weight, eps, residual) -> (normed, new_residual)
    silu_and_mul: SiluAndMul   # [..., 2n] -> [..., n]
    # Rotary on q and k, then the rotated k and v into the paged cache at meta.slot_mapping.
    # One op so that a kernel can fuse the two (the rotated k never exists outside the cache).
    rotary_store: RotaryStore
    linear: Linear             # (x, weight [N, K], bias [N] or None) -> x @ weight.T + bias
    # rms_norm then linear, and silu_and_mul then linear: one op each so that a kernel can fuse
    # the element-wise op into the matmul's input (kernels.fused_gemv at batch 1).
    norm_linear: NormLinear
    act_linear: ActLinear
    # norm_linear of the qkv weight, then rotary_store of its q, k, v: the attention's input
    # (kernels.fused_qkv at batch 1 on CUDA).
    norm_qkv_rotary_store: NormQkvRotaryStore


def compose_norm_linear(rms_norm: RmsNorm, linear: Linear) -> NormLinear:
    def norm_linear(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = rms_norm(h, norm_weight, eps, residual)
        return linear(x, weight, bias), residual
    return norm_linear


def compose_norm_qkv_rotary_store(norm_linear: NormLinear,
                                  rotary_store: RotaryStore) -> NormQkvRotaryStore:
    def norm_qkv_rotary_store(h: torch.Tensor, residual: torch.Tensor | None,
                              norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              bias: torch.Tensor | None, positions: torch.Tensor,
                              cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, backend: AttentionBackend,
                              heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(h, residual, norm_weight, eps, weight, bias)
        num_heads, num_kv_heads, d = heads
        t = qkv.shape[0]
        q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q = rotary_store(q.view(t, num_heads, d), k.view(t, num_kv_heads, d),
                         v.view(t, num_kv_heads, d), positions, cos_sin, k_cache, v_cache, meta,
                         backend)
        return q, residual
    return norm_qkv_rotary_store


def compose_act_linear(silu_and_mul: SiluAndMul, linear: Linear) -> ActLinear:
    def act_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        return linear(silu_and_mul(gate_up), weight, bias)
    return act_linear


def reference_rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           positions: torch.Tensor, cos_sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           backend: AttentionBackend) -> torch.Tensor:
    q, k = torch_ops.apply_rotary(q, k, positions, cos_sin)
    backend.store_kv(k, v, k_cache, v_cache, meta)
    return q


_reference_norm_linear = compose_norm_linear(torch_ops.rms_norm, reference_linear)
REFERENCE_OPS = ModelOps(
    rms_norm=torch_ops.rms_norm,
    silu_and_mul=torch_ops.silu_and_mul,
    rotary_store=reference_rotary_store,
    linear=reference_linear,
    norm_linear=_reference_norm_linear,
    act_linear=compose_act_linear(torch_ops.silu_and_mul, reference_linear),
    norm_qkv_rotary_store=compose_norm_qkv_rotary_store(_reference_norm_linear,
                                                        reference_rotary_store),
)
