"""FP8 weights (--quantization fp8): the projections quantized at load, as vLLM's online fp8.

Each projection (qkv, o, gate|up, down) of a bf16/fp32 checkpoint becomes an `Fp8Linear`: its
weight [N, K] in torch.float8_e4m3fn with one float32 scale per output channel (row), amax / 448
(kernels.torch_ops.quantize_rows), so W ~= qweight * scale. The embedding, the norms and the
logits weight stay in the model's dtype. Under tensor parallelism each rank quantizes its own
slices (a row-parallel weight's rows are scaled over the rank's columns). A checkpoint that
already holds fp8 weights and scales (compressed-tensors, or vLLM's fp8) loads into the same
`Fp8Linear`s without --quantization and is not quantized again: common.models.fp8_checkpoint.

`Fp8Linear.weight` is an `Fp8Weight` (qweight, scale), which the layers hand to `model.ops` as
they hand a plain weight; the ops decide how to multiply by it:

    CPU (REFERENCE_OPS)   the weight dequantized to x's dtype at each call (qweight * scale in
                          float32, rounded once), then F.linear: FP8 storage, activations
                          unquantized (W8A16). On float32 this is exactly the model whose
                          weights are the dequantized ones, which is what the tests compare
                          against Hugging Face.
    CUDA (TRITON_OPS)     batch 1: the GEMVs stream the fp8 weight and apply the scale (W8A16);
                          more rows: activations quantized per token and torch._scaled_mm
                          (W8A8, kernels.fp8_linear).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from kernels import torch_ops

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class Fp8Weight(NamedTuple):
    """A quantized projection weight: W ~= qweight * scale[:, None]."""
    qweight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor    # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch_ops.dequantize_rows(self.qweight, self.scale, dtype)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """weight [N, K] -> its per-output-channel fp8 form."""
    q, scale = torch_ops.quantize_rows(weight)
    return Fp8Weight(q.contiguous(), scale.view(-1).contiguous())


class Fp8Linear(nn.Module):
    """An nn.Linear whose weight is held in fp8 with per-row scales (see the module docstring);
    the bias, if any, stays in the model's dtype."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("weight_scale", weight.scale)
        self.bias = bias
        self.out_features, self.in_features = weight.qweight.shape

    @classmethod
    def quantized(cls, linear: nn.Linear) -> Fp8Linear:
        """linear's weight quantized per output channel (quantize_weight)."""
        return cls(quantize_weight(linear.weight.detach()), linear.bias)

    @classmethod
    def empty_like(cls, linear: nn.Linear) -> Fp8Linear:
        """Uninitialised fp8 storage of linear's shape, on its device, for a loader to fill
        (an fp8 checkpoint: common.models.fp8_checkpoint)."""
        n, k = linear.weight.shape
        device = linear.weight.device
        return cls(Fp8Weight(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device),
                             torch.empty(n, dtype=torch.float32, device=device)), linear.bias)

    @property
    def weight(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.weight_scale)


def replace_projections(model: nn.Module, make: Callable[[nn.Linear], Fp8Linear]) -> None:
    """Replace every decoder layer's projections (PROJECTIONS) by make(projection), in place
    (each full-precision weight is freed as it is replaced)."""
    for layer in model.layers:
        for path in PROJECTIONS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, make(getattr(parent, name)))
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()


def quantize_model(model: nn.Module) -> None:
    """Replace every decoder layer's projections by Fp8Linear, quantized at load, in place."""
    replace_projections(model, Fp8Linear.quantized)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def reference_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, on an fp8 weight through its dequantized copy (W8A16: the CPU path)."""
    if isinstance(weight, Fp8Weight):
        weight = weight.dequantize(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)
