"""ModelOps for the CPU whose projections run oneDNN's linear on weights reordered ("packed")
once: the CPU path's default where oneDNN is available (EngineConfig.cpu_linear).

On a many-core x86 CPU torch's default fp32 matmul (MKL through F.linear) is slow and uneven
at 2-16 rows, the batch sizes of decoding and speculative verification; oneDNN with a weight
packed for 64 rows ran SmolLM2-135M's projections at 7 rows as fast as at 1. Results differ
from F.linear by float rounding only (~1e-6 relative). bfloat16 weights are packed too where
oneDNN has bf16 kernels for the CPU (AVX-512 BF16 or AMX): at 32 rows SmolLM2's projections took
0.60 ms a layer against F.linear's 0.72, its logits 5.4 ms against 7.6 (2-core AVX-512 box).

install_cpu_ops packs a model's projections beside their originals. Freeing an original once
packed (its storage resized to nothing) was tried and undone: such a tensor keeps its shape, and
anything else that touches it (a test scaling a layer, a state_dict) reads freed memory and
crashes the process instead of raising. The logits weight is packed in float32 whatever the
model's dtype, so that a bf16 model's logits are float32 too (its bf16 hidden states widen
exactly).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from common.models.attention import AttentionBackend, AttentionMetadata
from common.models.fp8 import is_quantized
from common.models.ops import (
    REFERENCE_OPS,
    Heads,
    ModelOps,
    compose_act_linear,
    compose_norm_linear,
    compose_norm_qkv_rotary_store,
)
from kernels import cpu_layer_ops

# The row count oneDNN lays a packed weight out for; 64 beat 1 at every row count measured
# (1-64 rows, SmolLM2-135M on AVX-512).
BATCH_SIZE_HINT = 64


@functools.cache
def onednn_bf16_available() -> bool:
    """oneDNN has bf16 kernels for this CPU (else torch's own would run, slower than fp32)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def onednn_available() -> bool:
    """oneDNN is built in, exposes the two ops, and runs them on this CPU."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2), BATCH_SIZE_HINT)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((1, 2), 2.0)))


class OneDnnLinear:
    """F.linear's signature; each weight is packed at its first use (or by pack()) and the
    packed copy reused while the weight object lives and is not modified in place (its
    version counter is checked). Calls oneDNN cannot serve go to F.linear: dtypes other than
    float32 (and bfloat16 where oneDNN_bf16_available), mixed dtypes, tensors off the CPU, and
    calls autograd would record. A weight packed in float32 takes its input widened and gives
    float32. At up to 8 rows without a bias (a decode step's tail) the original weight goes
    through kernels.cpu_layer_ops.small_linear instead: oneDNN's GEMM on weights packed for 64
    rows streamed SmolLM2's projections at 8-25 GB/s at 1-8 rows on 2 cores, the kernel at
    20-83 GB/s (a bf16 weight packed in float32 then gives float32 from the bf16 table)."""

    def __init__(self, batch_size_hint: int = BATCH_SIZE_HINT):
        self.batch_size_hint = batch_size_hint
        # id(weight) -> (weight, its version when packed, packed copy); the weight is held so
        # that its id is not reused while the entry exists.
        self._packed: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.num_packs = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.serves(x, weight, bias):
            return F.linear(x, weight, bias)
        packed = self.pack(weight)
        x2 = x.reshape(-1, x.shape[-1])
        if bias is None and cpu_layer_ops.small_linear_serves(x2, weight):
            out = cpu_layer_ops.small_linear(x2, weight, float32_out=packed.dtype != x.dtype)
            return out.view(*x.shape[:-1], weight.shape[0])
        if packed.dtype != x.dtype:
            x2, bias = x2.to(packed.dtype), None if bias is None else bias.to(packed.dtype)
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])

    def serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        tensors = (x, weight) if bias is None else (x, weight, bias)
        return (packable(weight) and x.dim() >= 1
                and all(t.dtype == weight.dtype and t.device.type == "cpu" for t in tensors)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))

    def pack(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The packed copy of weight [N, K] (made now, in dtype, default the weight's, if there
        is none or it is stale)."""
        version = _version(weight)
        entry = self._packed.get(id(weight))
        if entry is not None and entry[0] is weight and entry[1] == version:
            return entry[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach().to(dtype or weight.dtype).contiguous(), self.batch_size_hint)
        self._packed[id(weight)] = (weight, version, packed)
        self.num_packs += 1
        return packed


def packable(weight: torch.Tensor) -> bool:
    return (onednn_available() and weight.dim() == 2 and weight.device.type == "cpu"
            and (weight.dtype == torch.float32
                 or (weight.dtype == torch.bfloat16 and onednn_bf16_available())))


def _version(t: torch.Tensor) -> int:
    # Inference tensors keep no version counter (and cannot be modified outside inference mode).
    return -1 if t.is_inference() else t._version


def onednn_ops(linear: OneDnnLinear) -> ModelOps:
    """The reference ops with linear; the norm, the activation and rotary with the K/V store
    through kernels.cpu_layer_ops where it serves (one pass each)."""
    norm_linear = compose_norm_linear(_rms_norm, linear)
    reference_qkv = compose_norm_qkv_rotary_store(norm_linear, REFERENCE_OPS.rotary_store)

    def norm_qkv_rotary_store(h: torch.Tensor, residual: torch.Tensor | None,
                              norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              bias: torch.Tensor | None, positions: torch.Tensor,
                              cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, backend: AttentionBackend,
                              heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel stores K/V itself: only for the torch backend's pool (store_kv's layout).
        if not (backend.name == "torch" and k_cache.dtype == h.dtype and h.dim() == 2
                and cpu_layer_ops.serves(h)):
            return reference_qkv(h, residual, norm_weight, eps, weight, bias, positions,
                                 cos_sin, k_cache, v_cache, meta, backend, heads)
        qkv, residual = norm_linear(h, residual, norm_weight, eps, weight, bias)
        q = cpu_layer_ops.rotary_store(qkv, heads[0], heads[1], positions, cos_sin, k_cache,
                                       v_cache, meta.slot_mapping)
        return q, residual

    return dataclasses.replace(
        REFERENCE_OPS, rms_norm=_rms_norm, silu_and_mul=_silu_and_mul, linear=linear,
        norm_linear=norm_linear, act_linear=compose_act_linear(_silu_and_mul, linear),
        norm_qkv_rotary_store=norm_qkv_rotary_store)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if cpu_layer_ops.serves(x) and weight.device.type == "cpu":
        return cpu_layer_ops.rms_norm(x, weight, eps, residual)
    return REFERENCE_OPS.rms_norm(x, weight, eps, residual)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if cpu_layer_ops.serves(x):
        return cpu_layer_ops.silu_and_mul(x)
    return REFERENCE_OPS.silu_and_mul(x)


def resolve_cpu_linear(name: str) -> str:
    """EngineConfig.cpu_linear -> "onednn" or "torch"."""
    if name == "auto":
        return "onednn" if onednn_available() else "torch"
    if name == "onednn" and not onednn_available():
        raise ValueError("cpu_linear onednn: this torch build or CPU has no usable oneDNN")
    return name


def install_cpu_ops(model: nn.Module, cpu_linear: str) -> None:
    """Sets model.ops for the CPU per cpu_linear. For oneDNN, packs the weights of its
    nn.Linear layers beside the originals (see the module docstring) and its logits weight
    (model.logits_weight, the embedding table when tied), in float32. A model with
    fp8 weights (common.models.fp8) takes the reference ops: a packed copy would be the
    dequantized weights, the memory that fp8 saves."""
    current = model.ops.linear
    if resolve_cpu_linear(cpu_linear) == "torch" or is_quantized(model):
        model.ops = REFERENCE_OPS
        return
    if isinstance(current, OneDnnLinear):  # a second runner on the same model
        return
    linear = OneDnnLinear()
    head = getattr(model, "logits_weight", None)
    if isinstance(head, torch.Tensor) and packable(head):
        linear.pack(head, torch.float32)
    for m in model.modules():  # an untied lm_head's float32 packing is reused
        if isinstance(m, nn.Linear) and packable(m.weight):
            linear.pack(m.weight)
    model.ops = onednn_ops(linear)
