"""ModelOps from kernels' Triton kernels: the element-wise ops of the CUDA path.

rms_norm (with the fused residual add) and silu_and_mul come from kernels.norm_act; rotary and
the K/V store are one launch (kernels.kv_store.rotary_store_kv), which writes K/V by slot mapping
itself, so the attention backend's store_kv is not called on this path.
"""

from __future__ import annotations

import torch

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.ops import ModelOps
from kernels import kv_store, norm_act


def _rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
    return kv_store.rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                    meta.slot_mapping)


TRITON_OPS = ModelOps(
    rms_norm=norm_act.rms_norm,
    silu_and_mul=norm_act.silu_and_mul,
    rotary_store=_rotary_store,
)
