"""ModelOps from kernels' Triton kernels: the ops of the CUDA path.

rms_norm (with the fused residual add) and silu_and_mul come from kernels.norm_act; rotary and
the K/V store are one launch (kernels.kv_store.rotary_store_kv), which writes K/V by slot mapping
itself, so the attention backend's store_kv is not called on this path. linear runs the skinny
GEMM (kernels.skinny_gemm) for the few rows of a decode step and cuBLAS (F.linear) otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.ops import ModelOps
from kernels import kv_store, norm_act, skinny_gemm


def _rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
    return kv_store.rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                    meta.slot_mapping)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if skinny_gemm.supports(x, weight, bias):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


TRITON_OPS = ModelOps(
    rms_norm=norm_act.rms_norm,
    silu_and_mul=norm_act.silu_and_mul,
    rotary_store=_rotary_store,
    linear=_linear,
)
