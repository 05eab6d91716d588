"""ModelOps from kernels' Triton kernels: the ops of the CUDA path.

rms_norm (with the fused residual add) and silu_and_mul come from kernels.norm_act; rotary and
the K/V store are one launch (kernels.kv_store.rotary_store_kv), which writes K/V by slot mapping
itself, so the attention backend's store_kv is not called on this path. linear runs the skinny
GEMM (kernels.skinny_gemm) for the few rows of a decode step and cuBLAS (F.linear) otherwise.
At batch 1, norm_linear and act_linear are one launch each (kernels.fused_gemv), and so is
norm_qkv_rotary_store (kernels.fused_qkv: norm, qkv GEMV, rotary and the K/V store); with more
rows they are the ops in turn. linear and rotary_store are public pieces: bench/gpu_profile.py
builds its unfused A/B set from them.

FP8 weights (common.models.fp8.Fp8Weight): the same batch-1 kernels read the fp8 weight and
apply its row scales; with more rows, linear quantizes the activations per token and runs
torch._scaled_mm (kernels.fp8_linear), or the dequantized weight where that does not apply;
norm_linear and act_linear then quantize in their norm / activation kernel (norm_act's _fp8
forms), so the GEMM follows with no quantization launch between.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.fp8 import Fp8Weight
from common.models.ops import (
    Heads,
    ModelOps,
    compose_act_linear,
    compose_norm_linear,
    compose_norm_qkv_rotary_store,
)
from kernels import fp8_linear, fused_gemv, fused_qkv, kv_store, norm_act, skinny_gemm

Weight = torch.Tensor | Fp8Weight


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
    return kv_store.rotary_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                    meta.slot_mapping)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Fp8Weight):
        q, scale = weight
        if skinny_gemm.supports(x, q, bias, fp8=True):
            return skinny_gemm.skinny_linear(x, q, bias, weight_scale=scale)
        if fp8_linear.supports(x, q):
            return fp8_linear.fp8_linear(x, q, scale, bias)
        return F.linear(x, weight.dequantize(x.dtype), bias)
    if skinny_gemm.supports(x, weight, bias):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _gemv_operands(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight tensor, its row scales or None, whether it is fp8) for the batch-1 kernels."""
    if isinstance(weight, Fp8Weight):
        return weight.qweight, weight.scale, True
    return weight, None, False


# The ops in turn: what the fused ops below run where their kernels do not apply (more rows).
_norm_linear_in_turn = compose_norm_linear(norm_act.rms_norm, linear)
_act_linear_in_turn = compose_act_linear(norm_act.silu_and_mul, linear)


def _quantized_gemm(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> bool:
    """Whether x [M, K] goes to the fp8 GEMM with its quantization fused into the kernel before
    (more rows than the GEMVs take, an fp8 weight that fp8_linear serves)."""
    return (isinstance(weight, Fp8Weight) and x.dim() == 2
            and not skinny_gemm.supports(x, weight.qweight, bias, fp8=True)
            and fp8_linear.supports(x, weight.qweight))


def norm_linear(h: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: Weight,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    w, scale, fp8 = _gemv_operands(weight)
    if fused_gemv.supports(h, w, bias, fp8=fp8):
        return fused_gemv.norm_linear(h, residual, norm_weight, eps, w, bias, weight_scale=scale)
    if _quantized_gemm(h, weight, bias):
        xq, xs, residual = norm_act.rms_norm_fp8(h, norm_weight, eps, residual)
        return fp8_linear.fp8_linear_prequantized(xq, xs, w, scale, bias, h.dtype), residual
    return _norm_linear_in_turn(h, residual, norm_weight, eps, weight, bias)


def act_linear(gate_up: torch.Tensor, weight: Weight,
               bias: torch.Tensor | None) -> torch.Tensor:
    w, scale, fp8 = _gemv_operands(weight)
    if fused_gemv.supports(gate_up, w, bias, fp8=fp8):
        return fused_gemv.act_linear(gate_up, w, bias, weight_scale=scale)
    if gate_up.dim() == 2 and _quantized_gemm(gate_up[:, :w.shape[1]], weight, bias):
        xq, xs = norm_act.silu_and_mul_fp8(gate_up)
        return fp8_linear.fp8_linear_prequantized(xq, xs, w, scale, bias, gate_up.dtype)
    return _act_linear_in_turn(gate_up, weight, bias)


_qkv_in_turn = compose_norm_qkv_rotary_store(norm_linear, rotary_store)


def norm_qkv_rotary_store(h: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: Weight,
                          bias: torch.Tensor | None, positions: torch.Tensor,
                          cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, backend: AttentionBackend,
                          heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
    w, scale, fp8 = _gemv_operands(weight)
    if fused_qkv.supports_qkv(h, w, bias, *heads, fp8=fp8):
        return fused_qkv.norm_qkv_rotary_store(
            h, residual, norm_weight, eps, w, bias, positions, cos_sin, k_cache,
            v_cache, meta.slot_mapping, heads[0], weight_scale=scale)
    return _qkv_in_turn(h, residual, norm_weight, eps, weight, bias, positions, cos_sin,
                        k_cache, v_cache, meta, backend, heads)


TRITON_OPS = ModelOps(
    rms_norm=norm_act.rms_norm,
    silu_and_mul=norm_act.silu_and_mul,
    rotary_store=rotary_store,
    linear=linear,
    norm_linear=norm_linear,
    act_linear=act_linear,
    norm_qkv_rotary_store=norm_qkv_rotary_store,
)
